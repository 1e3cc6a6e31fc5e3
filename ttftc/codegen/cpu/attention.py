"""ttftc.attention on CPU through ATen's flash-attention kernel (aten._scaled_dot_product_flash_attention_for_cpu).

Why this kernel: benchmarks/attention_cpu.py compares it with the reference (query-chunked matmul + softmax) and
with a query-blocked matmul/softmax loop; in fp32 it is the fastest exact path measured, it streams K/V in blocks
(no Sq x Skv score tensor), and it maps GQA heads itself, so K and V are never repeated. Its inner products stay
in fp32 whatever the input dtype, so where the CPU has native bf16 GEMMs, plain causal prefill in bf16 runs faster
as batched bf16 GEMMs per block of query rows (`gemm_blocks`); which of the two runs is measured once per process
(`fastest_causal_kernel`) or set by `ttftc autotune` (`causal_kernel`).

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

import functools
import time
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
    # Plain causal prefill: "flash" (ATen's kernel), "gemm_blocks" (_causal_gemm_blocks), or None: whichever
    # fastest_causal_kernel measured faster on this CPU for the dtype.
    "causal_kernel": None,
    # Query rows per block of the gemm_blocks kernel (scores per block: heads x rows x keys).
    "gemm_block_rows": 128,
}
CAUSAL_KERNELS = ("flash", "gemm_blocks")
_OFFSET_AND_WINDOW_KNOBS = ("window_block_rows", "small_mask_pairs")
_PLAIN_CAUSAL_KNOBS = ("causal_kernel", "gemm_block_rows")


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


def _causal_gemm_blocks(q, k, v, scale: float, block_rows: int) -> torch.Tensor:
    """Causal (top-left) attention as two batched GEMMs per block of query rows, in the flash layout.

    Why: where the CPU has native bf16, oneDNN's bf16 bmm runs far faster than ATen's flash kernel, whose inner
    products stay in fp32 (AMD EPYC with avx512_bf16, 9 heads x 2048 tokens x 64: 18.7 ms against 38.4 ms). Each
    block scores its rows against keys [0, stop) only (the causal half), so scores are rows x stop per head, never
    Sq x Skv. Numerics are those of Hugging Face's eager attention: scores in the input dtype, softmax accumulated
    in fp32. GQA heads share their K/V head through the batch dimension, so K and V are never repeated.
    """
    b, h, sq, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    group = h // hkv
    out = torch.empty(b, sq, h, dv, dtype=q.dtype, device=q.device).transpose(1, 2)
    keys = k.reshape(b * hkv, sq, d).contiguous()  # once, not once per block
    values = v.reshape(b * hkv, sq, dv).contiguous()
    grouped_q = q.reshape(b, hkv, group, sq, d)
    hidden = torch.ones(block_rows, block_rows, dtype=torch.bool, device=q.device).triu_(1)
    for start in range(0, sq, block_rows):
        stop = min(sq, start + block_rows)
        rows = stop - start
        block_q = (grouped_q[:, :, :, start:stop] * scale).reshape(b * hkv, group * rows, d)
        scores = torch.bmm(block_q, keys[:, :stop].transpose(1, 2))
        scores.view(b * hkv, group, rows, stop)[..., start:stop].masked_fill_(hidden[:rows, :rows], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        block_out = torch.bmm(probs, values[:, :stop])
        out[:, :, start:stop] = block_out.view(b, h, rows, dv)
    return out


def _causal_kernel_seconds(kernel: str, dtype: torch.dtype, repeats: int = 3) -> float:
    q, k, v = (torch.randn(1, 512, 8, 64).to(dtype).transpose(1, 2) for _ in range(3))
    run = ((lambda: _flash(q, k, v, 0.0, True, scale=0.125)) if kernel == "flash"
           else (lambda: _causal_gemm_blocks(q, k, v, 0.125, DEFAULT_TUNING["gemm_block_rows"])))
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def causal_kernel_seconds(dtype: torch.dtype) -> dict[str, float]:
    """Seconds of each plain-causal kernel at a prefill-sized problem (8 heads x 512 tokens x 64) on this CPU,
    measured once per process and dtype: which is faster depends on the CPU (native bf16 GEMMs or not)."""
    return {kernel: _causal_kernel_seconds(kernel, dtype) for kernel in CAUSAL_KERNELS}


def fastest_causal_kernel(dtype: torch.dtype) -> str:
    """The plain-causal kernel to use when no tuned config names one: flash in fp32 (measured no slower there on
    either CPU family we know, and skipping the probe keeps fp32 start-up cheap), else the faster one measured."""
    if dtype == torch.float32:
        return "flash"
    times = causal_kernel_seconds(dtype)
    return min(times, key=times.get)


def _attend(q, k, v, *, causal: bool, scale: float, q_offset: int, window: int, tuning: dict) -> torch.Tensor:
    sq, skv = q.shape[2], k.shape[2]
    if sq == 0 or skv == 0:
        return _zeros_like_out(q, v)
    if not causal:
        return _flash(q, k, v, 0.0, False, scale=scale)[0]
    window_binds = 0 < window < q_offset + sq  # the window hides keys from at least one row
    if q_offset == 0 and not window_binds and sq == skv:
        kernel = tuning["causal_kernel"] or fastest_causal_kernel(q.dtype)
        if kernel == "gemm_blocks" and q.shape[1] % k.shape[1] == 0:
            return _causal_gemm_blocks(q, k, v, scale, int(tuning["gemm_block_rows"]))
        return _flash(q, k, v, 0.0, True, scale=scale)[0]
    if q_offset == 0 and not window_binds:
        return _flash(q, k, v, 0.0, True, scale=scale)[0]
    if sq * skv <= tuning["small_mask_pairs"]:
        return _full_mask(q, k, v, scale, q_offset, window if window_binds else 0)
    if window_binds:
        return _sliding_window(q, k, v, scale, q_offset, window, tuning["window_block_rows"])
    return _causal_from_offset(q, k, v, scale, q_offset)


def _default_config(problem: Problem) -> dict:
    return {**DEFAULT_TUNING, "causal_kernel": fastest_causal_kernel(problem.args[0].dtype)}


def _knobs_of_its_path(config: dict, problem: Problem) -> Optional[str]:
    # The offset/window knobs only steer the offset/window paths, the causal kernel knobs only plain causal
    # prefill: a knob of the other path would only multiply identical candidates.
    options = problem.options
    plain = options.get("q_offset", 0) == 0 and options.get("window", 0) == 0
    default = _default_config(problem)
    idle = _OFFSET_AND_WINDOW_KNOBS if plain else _PLAIN_CAUSAL_KNOBS
    if any(config[name] != default[name] for name in idle):
        return f"{'plain causal' if plain else 'offset/window'} attention ignores {', '.join(idle)}"
    if plain and config["causal_kernel"] == "flash" and config["gemm_block_rows"] != default["gemm_block_rows"]:
        return "the flash kernel ignores gemm_block_rows"
    return None


register_space(with_thread_axis(SearchSpace(
    "attention", "cpu",
    axes={"window_block_rows": (64, 128, 256, 512), "small_mask_pairs": (0, 1 << 18, 1 << 20, 1 << 22),
          "causal_kernel": CAUSAL_KERNELS, "gemm_block_rows": (64, 128, 256)},
    default=_default_config,
    constraints=(_knobs_of_its_path,),
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
