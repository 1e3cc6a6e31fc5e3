"""ttftc.attention on CPU through ATen's flash-attention kernel (aten._scaled_dot_product_flash_attention_for_cpu).

Why this kernel: benchmarks/attention_cpu.py compares it with the reference (query-chunked matmul + softmax) and
with a query-blocked matmul/softmax loop; it is the fastest exact path measured here, it streams K/V in blocks
(no Sq x Skv score tensor), and it maps GQA heads itself, so K and V are never repeated.

The kernel only knows "causal, top-left aligned" or an additive mask. Small offset/window cases (at most
DEFAULT_TUNING["small_mask_pairs"] query-key pairs; autotunable) get an explicit additive mask, which measured fastest there; larger ones are
rewritten so that nothing Sq x Skv is ever allocated:
- causal with q_offset > 0 (bottom-right / chunked prefill): keys [0, q_offset) are visible to every query and
  keys [q_offset, Skv) are causal top-left, so two kernel calls are merged exactly through their logsumexps;
- a sliding window that binds: query blocks, each against only the keys its window can reach, with a small
  additive mask (block x (block + window)), never a full Sq x Skv one;
- per-sequence kv_len: one call per sequence on its own key prefix.
Rows that see no key return zeros, as the contract says.
"""

from __future__ import annotations

from typing import Optional

import torch

from ttftc.autotune.space import Problem, SearchSpace, register_space
from ttftc.codegen.cpu._threads import honours_num_threads, with_thread_axis
from ttftc.codegen.lowering import register_lowering
from ttftc.ops.attention import attention_mask

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_TUNING = {
    # Query rows per block in the sliding-window path: mask and scores per block stay rows x (rows + window).
    "window_block_rows": 256,
    # Up to this many (query, key) pairs, an explicit additive mask (4 MiB in fp32) and one flash call beat the
    # memory-bounded rewrites (benchmarks/attention_cpu.py: offset and window cases at 512 vs 2048 tokens).
    "small_mask_pairs": 1 << 20,
}


def _unsupported_reason(ctx, q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0) -> Optional[str]:
    if ctx.device_type != "cpu":
        return f"tensors are on {ctx.device_type}"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} is not fp32/fp16/bf16"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v are not 4-D"
    if q.shape[-1] != k.shape[-1] or v.shape[-1] != q.shape[-1]:
        return "the flash kernel needs one head dim for q, k and v"
    if kv_len is not None and (kv_len.dtype.is_floating_point or kv_len.dim() != 1):
        return "kv_len is not a 1-D integer tensor"
    if q_offset < 0 or window < 0:
        return "negative q_offset or window"
    return None


def _zeros_like_out(q, v) -> torch.Tensor:
    return q.new_zeros(q.shape[:-1] + (v.shape[-1],))


def _causal_from_offset(q, k, v, scale: float, q_offset: int) -> torch.Tensor:
    """Causal attention with the diagonal at q_offset, from two flash calls merged by logsumexp."""
    skv = k.shape[2]
    if q_offset == 0:
        return _flash(q, k, v, 0.0, True, scale=scale)[0]
    if q_offset >= skv:  # every row's diagonal is past the last key: nothing is masked
        return _flash(q, k, v, 0.0, False, scale=scale)[0]
    out_prefix, lse_prefix = _flash(q, k[:, :, :q_offset], v[:, :, :q_offset], 0.0, False, scale=scale)
    out_diag, lse_diag = _flash(q, k[:, :, q_offset:], v[:, :, q_offset:], 0.0, True, scale=scale)
    top = torch.maximum(lse_prefix, lse_diag)
    w_prefix = torch.exp(lse_prefix - top).unsqueeze(-1)
    w_diag = torch.exp(lse_diag - top).unsqueeze(-1)
    merged = (out_prefix.float() * w_prefix + out_diag.float() * w_diag) / (w_prefix + w_diag)
    return merged.to(q.dtype)


def _sliding_window(q, k, v, scale: float, q_offset: int, window: int, block_rows: int) -> torch.Tensor:
    sq, skv = q.shape[2], k.shape[2]
    out = _zeros_like_out(q, v)
    for start in range(0, sq, block_rows):
        stop = min(sq, start + block_rows)
        first_pos, last_pos = q_offset + start, q_offset + stop - 1
        lo, hi = max(0, first_pos - window + 1), min(skv, last_pos + 1)
        if hi <= lo:
            continue
        pos = torch.arange(first_pos, last_pos + 1)[:, None]
        cols = torch.arange(lo, hi)[None, :]
        visible = (cols <= pos) & (cols > pos - window)
        mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
        block = _flash(q[:, :, start:stop], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, False, attn_mask=mask, scale=scale)[0]
        seen = visible.any(-1)
        out[:, :, start:stop] = block if bool(seen.all()) else block * seen[:, None].to(block.dtype)
    return out


def _full_mask(q, k, v, scale: float, q_offset: int, window: int) -> torch.Tensor:
    """One flash call with an additive [Sq, Skv] mask: the fastest path while that mask is small."""
    visible = attention_mask(q.shape[2], k.shape[2], causal=True, q_offset=q_offset, window=window, kv_len=None,
                             device=q.device)[0, 0]
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
    out = _flash(q, k, v, 0.0, False, attn_mask=mask, scale=scale)[0]
    seen = visible.any(-1)
    return out if bool(seen.all()) else out * seen[:, None].to(out.dtype)


def _attend(q, k, v, *, causal: bool, scale: float, q_offset: int, window: int, tuning: dict) -> torch.Tensor:
    sq, skv = q.shape[2], k.shape[2]
    if sq == 0 or skv == 0:
        return _zeros_like_out(q, v)
    if not causal:
        return _flash(q, k, v, 0.0, False, scale=scale)[0]
    window_binds = 0 < window < q_offset + sq  # the window hides keys from at least one row
    if q_offset == 0 and not window_binds:
        return _flash(q, k, v, 0.0, True, scale=scale)[0]
    if sq * skv <= tuning["small_mask_pairs"]:
        return _full_mask(q, k, v, scale, q_offset, window if window_binds else 0)
    if window_binds:
        return _sliding_window(q, k, v, scale, q_offset, window, tuning["window_block_rows"])
    return _causal_from_offset(q, k, v, scale, q_offset)


def _only_offset_or_window_cases(config: dict, problem: Problem) -> Optional[str]:
    # These knobs only steer the offset/window paths; plain causal prefill is one flash call whatever they say
    # (only its thread count is worth a search).
    options = problem.options
    path_knobs = {name: config[name] for name in DEFAULT_TUNING}
    if options.get("q_offset", 0) == 0 and options.get("window", 0) == 0 and path_knobs != DEFAULT_TUNING:
        return "plain causal attention has no path knob: one flash call"
    return None


register_space(with_thread_axis(SearchSpace(
    "attention", "cpu",
    axes={"window_block_rows": (64, 128, 256, 512), "small_mask_pairs": (0, 1 << 18, 1 << 20, 1 << 22)},
    default=lambda problem: dict(DEFAULT_TUNING),
    constraints=(_only_offset_or_window_cases,),
)))


def _flash_layout_fake(q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0, tuning_config=None):
    """The output layout of this lowering: [B, H, S, D] stored as [B, S, H, D], the flash kernel's own (so the
    transpose back to [B, S, H*D] that every model does next is free)."""
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1])).transpose(1, 2)


def _in_flash_layout(out: torch.Tensor) -> torch.Tensor:
    if out.transpose(1, 2).is_contiguous():
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


@register_lowering("attention", "cpu", unsupported_reason=_unsupported_reason, priority=10, fake=_flash_layout_fake)
@honours_num_threads
def attention_cpu(q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0, tuning_config=None):
    tuning = {**DEFAULT_TUNING, **(tuning_config or {})}
    params = dict(causal=causal, scale=float(scale), q_offset=int(q_offset), window=int(window), tuning=tuning)
    if kv_len is None:
        return _in_flash_layout(_attend(q, k, v, **params))
    skv = k.shape[2]
    lengths = [max(0, min(int(n), skv)) for n in kv_len.tolist()]
    if all(n == skv for n in lengths):
        return _in_flash_layout(_attend(q, k, v, **params))
    out = _flash_layout_fake(q, k, v, causal=causal, scale=scale)  # every sequence's rows are written below
    for b, n in enumerate(lengths):
        out[b : b + 1] = _attend(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], **params)
    return out
