"""ttftc.attention on CPU: ttftc's own fp32 kernel, ATen's flash-attention kernel, or batched GEMMs per block.

Three kernels, and which one runs is measured once per machine and dtype (`fastest_kernel`; kept by measured.py)
or set by `ttftc autotune` (the `kernel` knob):
- "native": ttftc's kernel (csrc/attention_kernel.h, built at install): FlashAttention-2's online softmax with the
  queries along the vector lanes, every mask the op has (causal at any q_offset, sliding window, per-sequence
  kv_len) in one pass, GQA by head mapping; fp32, and bf16 on CPUs with AVX512-BF16 dot products
  (csrc/attention_bf16_kernel.h). benchmarks/attention_cpu.py measures it against the others.
- "flash": aten._scaled_dot_product_flash_attention_for_cpu. It streams K/V in blocks (no Sq x Skv scores) and maps
  GQA heads itself, but keeps its inner products in fp32 whatever the input dtype.
- "gemm_blocks": plain causal prefill as batched GEMMs per block of query rows, which runs bf16 on the CPU's native
  bf16 GEMMs where it has them (the other masks go to flash).

The flash kernel only knows "causal, top-left aligned" or an additive mask. Small offset/window cases (at most
DEFAULT_TUNING["small_mask_pairs"] query-key pairs; autotunable) get an explicit additive mask, which measured
fastest there; larger ones are rewritten so that nothing Sq x Skv is ever allocated:
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
from ttftc.codegen.cpu import _native
from ttftc.codegen.cpu._threads import honours_num_threads, with_thread_axis
from ttftc.codegen.cpu.measured import Provenance, checked_times, prefer, recall
from ttftc.codegen.registry import register_lowering
from ttftc.ops.attention import attention_mask

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_TUNING = {
    # Query rows per block in the sliding-window path: mask and scores per block stay rows x (rows + window).
    "window_block_rows": 256,
    # Up to this many (query, key) pairs, an explicit additive mask (4 MiB in fp32) and one flash call beat the
    # memory-bounded rewrites (benchmarks/attention_cpu.py: offset and window cases at 512 vs 2048 tokens).
    "small_mask_pairs": 1 << 20,
    # "native" (every case; fp32, and bf16 where the CPU has AVX512-BF16), "flash", "gemm_blocks" (plain causal;
    # other masks take flash), or None:
    # whichever fastest_kernel measured fastest on this CPU for the dtype.
    "kernel": None,
    # Query rows per block of the gemm_blocks kernel (scores per block: heads x rows x keys).
    "gemm_block_rows": 128,
    # Keys per block of the native kernel (scores per block: keys x the work item's 16-48 queries).
    "native_block_k": 128,
}
KERNELS = ("flash", "gemm_blocks", "native")
# The near-tie order (measured.prefer): ttftc's kernel covers every mask in one pass, then ATen's flash kernel.
PREFERENCE = ("native", "flash", "gemm_blocks")
# The knobs each kernel reads (the flash knobs steer its offset/window rewrites).
_KNOBS = {"flash": ("window_block_rows", "small_mask_pairs"), "gemm_blocks": ("gemm_block_rows",),
          "native": ("native_block_k",)}


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

    Why: where the CPU has native bf16, oneDNN's bf16 bmm can run far faster than ATen's flash kernel, whose inner
    products stay in fp32 (benchmarks/README.md, attention kernels). Each
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


def kernels_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels that can run this dtype in this process."""
    return KERNELS if dtype in _native.attention_dtypes() else tuple(k for k in KERNELS if k != "native")


def _kernel_seconds(kernel: str, dtype: torch.dtype, repeats: int = 3) -> float:
    q, k, v = (torch.randn(1, 512, 8, 64).to(dtype).transpose(1, 2) for _ in range(3))
    tuning = {**DEFAULT_TUNING, "kernel": kernel}
    run = lambda: _attend(q, k, v, None, causal=True, scale=0.125, q_offset=0, window=0, tuning=tuning)  # noqa: E731
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _stored_seconds(raw, dtype: torch.dtype) -> dict[str, float]:
    """Stored kernel times; ValueError unless they are exactly the kernels that run this dtype here now (a
    record naming the native kernel where it is not built, or lacking it where it is, is measured again)."""
    times = checked_times(raw, KERNELS)
    if set(times) != set(kernels_for(dtype)):
        raise ValueError(f"kernels {sorted(times)} are not the ones that run {dtype} here: {list(kernels_for(dtype))}")
    return times


@functools.cache
def kernel_measurement(dtype: torch.dtype) -> tuple[dict[str, float], Provenance]:
    """Seconds of each kernel at a prefill-sized causal problem (8 heads x 512 tokens x 64) on this CPU, measured
    once per machine and dtype (kept by measured.py): which is fastest depends on the CPU (its vector width,
    native bf16 or not). With where the times came from."""
    return recall(f"attention:{str(dtype).removeprefix('torch.')}",
                  lambda: {kernel: _kernel_seconds(kernel, dtype) for kernel in kernels_for(dtype)}, dict,
                  lambda raw: _stored_seconds(raw, dtype))


def kernel_seconds(dtype: torch.dtype) -> dict[str, float]:
    """Seconds of each kernel that runs `dtype` here (kernel_measurement)."""
    return kernel_measurement(dtype)[0]


def fastest_kernel(dtype: torch.dtype) -> str:
    """The kernel to use when no tuned config names one: the fastest one measured for the dtype (a near-tie goes
    to PREFERENCE)."""
    return prefer(kernel_seconds(dtype), PREFERENCE)


def describe_kernel_choice(dtype: torch.dtype) -> str:
    """e.g. "fp32 attention: native (A ms; flash B ms; gemm_blocks C ms at 8 heads x 512 tokens x 64, causal;
    measured now, ...)"."""
    times, provenance = kernel_measurement(dtype)
    chosen = fastest_kernel(dtype)
    others = "".join(f"; {kernel} {seconds * 1e3:.1f} ms" for kernel, seconds in sorted(times.items())
                     if kernel != chosen)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return (f"{name} attention: {chosen} ({times[chosen] * 1e3:.1f} ms{others} at 8 heads x 512 tokens x 64, "
            f"causal; {provenance.describe()})")


def _native_attention(q, k, v, kv_len, *, causal: bool, scale: float, q_offset: int, window: int,
                      block_k: int) -> torch.Tensor:
    out = _empty_out(q, v)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    # K/V rows a multiple of 4 KiB apart (16 interleaved fp32 heads of 64) fall into the same L1 sets. The kernel's
    # copy into its tile order pays once enough queries read each key (the 128 below is the measured crossover:
    # benchmarks/README.md, attention kernels); rows at other strides are read in place.
    rows_alias = any((t.stride(2) * t.element_size()) % 4096 == 0 and t.stride(2) != t.shape[-1] for t in (k, v))
    pack_kv = rows_alias and q.dtype == torch.float32 and q.shape[2] * (q.shape[1] // k.shape[1]) >= 128
    lengths = None if kv_len is None else kv_len.to(torch.int64).contiguous()
    return _native.attention(q, k, v, out, lengths, causal=causal, scale=scale, q_offset=q_offset,
                             window=window if causal else 0, block_k=block_k, threads=torch.get_num_threads(),
                             pack_kv=pack_kv)


def _attend(q, k, v, kv_len, *, causal: bool, scale: float, q_offset: int, window: int, tuning: dict) -> torch.Tensor:
    kernel = tuning["kernel"] or fastest_kernel(q.dtype)
    if kernel == "native" and _native.attention_reason(q, k, v, q_offset) is None:
        return _native_attention(q, k, v, kv_len, causal=causal, scale=scale, q_offset=q_offset, window=window,
                                 block_k=int(tuning["native_block_k"]))
    if kv_len is not None:
        return _per_sequence(q, k, v, kv_len, causal=causal, scale=scale, q_offset=q_offset, window=window,
                             tuning=tuning)
    sq, skv = q.shape[2], k.shape[2]
    if sq == 0 or skv == 0:
        return _zeros_like_out(q, v)
    if not causal:
        return _flash(q, k, v, 0.0, False, scale=scale)[0]
    window_binds = 0 < window < q_offset + sq  # the window hides keys from at least one row
    if q_offset == 0 and not window_binds and sq == skv:
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


def _plain(problem: Problem) -> bool:
    return problem.options.get("q_offset", 0) == 0 and problem.options.get("window", 0) == 0


def _default_config(problem: Problem) -> dict:
    kernel = fastest_kernel(problem.args[0].dtype)
    if kernel == "gemm_blocks" and not _plain(problem):
        kernel = "flash"  # what the lowering runs there without a tuned config
    return {**DEFAULT_TUNING, "kernel": kernel}


def _knobs_of_its_kernel(config: dict, problem: Problem) -> Optional[str]:
    # A knob the chosen kernel does not read would only multiply identical candidates.
    kernel = config["kernel"]
    if kernel not in kernels_for(problem.args[0].dtype):
        return f"the {kernel} kernel does not run {problem.args[0].dtype} here"
    plain = _plain(problem)
    if kernel == "gemm_blocks" and not plain:
        return "gemm_blocks only runs plain causal attention (the rest is flash's)"
    read = _KNOBS[kernel] if (kernel != "flash" or not plain) else ()
    idle = [name for knobs in _KNOBS.values() for name in knobs if name not in read]
    if any(config[name] != DEFAULT_TUNING[name] for name in idle):
        return f"the {kernel} kernel ignores {', '.join(idle)} here"
    return None


register_space(with_thread_axis(SearchSpace(
    "attention", "cpu",
    axes={"window_block_rows": (64, 128, 256, 512), "small_mask_pairs": (0, 1 << 18, 1 << 20, 1 << 22),
          "kernel": KERNELS, "gemm_block_rows": (64, 128, 256), "native_block_k": (32, 64, 128, 256)},
    default=_default_config,
    constraints=(_knobs_of_its_kernel,),
)))


def _empty_out(q, v) -> torch.Tensor:
    """The output layout of this lowering: [B, H, S, D] stored as [B, S, H, D], the flash kernel's own (so the
    transpose back to [B, S, H*D] that every model does next is free)."""
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1])).transpose(1, 2)


def _flash_layout_fake(q, k, v, *_, **__):
    """The lowering's output for tracing: its layout depends on q and v alone."""
    return _empty_out(q, v)


def _in_flash_layout(out: torch.Tensor) -> torch.Tensor:
    if out.transpose(1, 2).is_contiguous():
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _per_sequence(q, k, v, kv_len, *, causal, scale, q_offset, window, tuning) -> torch.Tensor:
    """Per-sequence key lengths for the ATen kernels: one call per sequence on its own key prefix."""
    skv = k.shape[2]
    lengths = [max(0, min(int(n), skv)) for n in kv_len.tolist()]
    params = dict(causal=causal, scale=scale, q_offset=q_offset, window=window, tuning=tuning)
    if all(n == skv for n in lengths):
        return _attend(q, k, v, None, **params)
    out = _empty_out(q, v)  # every sequence's rows are written below
    for b, n in enumerate(lengths):
        # indexed, not sliced: flash takes the batch size from q and never checks k's or v's, so a wrong slice
        # would go unnoticed
        out[b] = _attend(q[b, None], k[b, None, :, :n], v[b, None, :, :n], None, **params)[0]
    return out


@register_lowering("attention", "cpu", unsupported_reason=_unsupported_reason, priority=10, fake=_flash_layout_fake)
@honours_num_threads
def attention_cpu(q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0, tuning_config=None):
    tuning = {**DEFAULT_TUNING, **(tuning_config or {})}
    out = _attend(q, k, v, kv_len, causal=causal, scale=float(scale), q_offset=int(q_offset), window=int(window),
                  tuning=tuning)
    return _in_flash_layout(out)
