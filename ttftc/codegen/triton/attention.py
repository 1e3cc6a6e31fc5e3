"""ttftc.attention as a Triton FlashAttention-2 forward kernel.

One program owns BLOCK_M query rows of one (batch, query head): the Q tile stays resident while K/V tiles stream
past it, with the online softmax in base 2 (scores pre-multiplied by scale * log2(e), so exp2 replaces exp).
Per program the key tiles fall into three ranges, walked in order:
  1. tiles the sliding window only partly covers (masked),
  2. tiles every row of the block fully sees (no mask work at all),
  3. the tiles crossing the causal diagonal or the kv_len end (masked);
tiles entirely above the diagonal or below the window are never visited (causal tile skipping).

GQA maps query head h to KV head h // (Hq / Hkv) when computing the K/V pointers; nothing is repeated.
`q_offset` puts query row i at absolute position q_offset + i (bottom-right alignment when q_offset = Skv - Sq);
`kv_len[b]` ends sequence b's keys early (padded buckets). Head dims that are not a power of two (80, 96, and
16/32-padded small ones) are padded to the next power of two with masked loads.

Tuning: `candidate_configs()` lists the (BLOCK_M, BLOCK_N, num_warps, num_stages) space as data, pruned for a
compile target (targets.json: shared memory per block, warp size) by an upper bound on shared memory and a coarse
register rule, both checked against compiled kernels; `launch(..., config=...)` runs any of them, so an autotuner
can search without touching the kernel. `ttftc kernels` compiles every such config for sm_80, sm_90 and gfx942.

Two kernels share one tile body (`_attention_block`): `_attention_fwd`, one program per (row block, batch x head),
for GPUs; and `_attention_fwd_persistent`, for triton-ascend, whose grid is the core count and whose programs loop
over the tiles (tile = pid, pid + programs, ...). Both are exact under TRITON_INTERPRET=1; the persistent one lowers
to triton-ascend's IR for Ascend910B3 but never ran on an NPU.

The Triton interpreter (TRITON_INTERPRET=1, how CI runs this on CPU) cannot do bf16 arithmetic, so there every
tile is cast to fp32 right after loading (UPCAST).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ttftc.autotune.space import Problem, SearchSpace, register_space, space_for
from ttftc.codegen.registry import register_lowering
from ttftc.codegen.triton.ascend_device import current_device, launch_grid
from ttftc.codegen.triton.launch import KernelLaunch
from ttftc.codegen.triton.targets import Target, current_target

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # ttftc must import without triton; the lowering then reports itself incapable
    triton = None
    tl = None
    HAS_TRITON = False

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# The knobs an autotuner searches, and the rules that prune them (see `prune_reason`).
TUNING_AXES = {
    "block_m": (16, 32, 64, 128),
    "block_n": (16, 32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3, 4),
}
# Shared memory assumed for a device the target table does not know and cannot be asked (the interpreter).
_DEFAULT_SMEM_BYTES = 100 * 1024
# fp32 values one lane may hold for the scores (BLOCK_M x BLOCK_N) and the accumulator (BLOCK_M x head dim)
# before the tiles spill: tensor-core dots (16-bit inputs) keep little else live; IEEE fp32 dots run on FMA units
# and hold operand fragments too. Calibrated on `ttftc kernels` sweeps (triton 3.9; see register_reason).
_LANE_VALUES = {"cuda": 128, "hip": 96}
_LANE_VALUES_FP32 = 24


def register_reason(config: dict, head_dim: int, dtype: torch.dtype, target: Optional[Target]) -> Optional[str]:
    """A coarse register-pressure rule: it prunes the tiles that spill heavily, not every config that spills a few
    bytes (those stay candidates; the tuner times them). Defaults are checked not to spill by compiling them."""
    bm, bn, warps, stages = config["block_m"], config["block_n"], config["num_warps"], config["num_stages"]
    d = padded_head_dim(head_dim)
    backend = target.backend if target is not None else "cuda"
    lanes = (target.warp_size if target is not None else 32) * warps
    held = (bm * bn + bm * d) / lanes
    limit = _LANE_VALUES_FP32 if dtype == torch.float32 else _LANE_VALUES.get(backend, 128)
    if held > limit:
        return f"{held:.0f} fp32 score and accumulator values per lane (over {limit}) spill registers"
    if backend == "hip":
        # A 512-lane workgroup (8 wave64 warps) gets 256 VGPRs per lane instead of 512.
        if warps == 8 and (bn == 128 or (bn == 64 and stages >= 3)):
            return "8 wave64 warps have 256 VGPRs per lane: K/V tiles this wide and deep spill"
        if bn == 128 and d >= 128 and stages >= 4:
            return "128-wide K/V tiles of a 128-wide head, 4 stages deep, spill"
    return None


def shared_memory_bytes(config: dict, head_dim: int, dtype: torch.dtype, target: Optional[Target] = None) -> int:
    """An upper bound on one program's shared memory, checked against compiled kernels (triton 3.9):
    NVIDIA: the Q tile and K and V tiles num_stages deep, plus 1 KB of static shared memory on sm_90;
    AMD: K and V tiles num_stages - 1 deep (the stream pipeliner) plus one layout-conversion tile."""
    item = torch.tensor([], dtype=dtype).element_size()
    bm, bn, stages, d = config["block_m"], config["block_n"], config["num_stages"], padded_head_dim(head_dim)
    if target is not None and target.backend == "hip":
        return 2 * bn * d * item * max(1, stages - 1) + max(bm * bn, bm * d) * item
    return (bm + 2 * bn * stages) * d * item + 1024


def candidate_configs(head_dim: int, dtype: torch.dtype, q_len: Optional[int] = None,
                      target: Optional[Target] = None) -> list[AttentionConfig]:
    """The pruned search space on `target` (None: a device with _DEFAULT_SMEM_BYTES), as kernel configs."""
    names = list(TUNING_AXES)
    configs = []
    for values in itertools.product(*(TUNING_AXES[n] for n in names)):
        config = dict(zip(names, values))
        if prune_reason(config, head_dim, dtype, q_len, target) is None:
            configs.append(AttentionConfig(**config))
    return configs


def prune_reason(config: dict, head_dim: int, dtype: torch.dtype, q_len: Optional[int],
                 target: Optional[Target]) -> Optional[str]:
    """Why `config` cannot serve this problem on `target`, or None."""
    if config["block_n"] > max(64, padded_head_dim(head_dim)):
        return "BLOCK_N above the head dim and 64"
    if q_len is not None and config["block_m"] > max(16, triton_next_pow2(q_len)):
        return f"BLOCK_M {config['block_m']} is larger than the {q_len}-row prompt"
    reason = register_reason(config, head_dim, dtype, target)
    if reason:
        return reason
    limit = target.shared_memory_per_block if target is not None else _DEFAULT_SMEM_BYTES
    need = shared_memory_bytes(config, head_dim, dtype, target)
    if need > limit:
        where = target.device if target is not None else "the device"
        return f"needs {need // 1024} KB of shared memory, {where} allows {limit // 1024} KB per block"
    return None


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def default_config(head_dim: int, dtype: torch.dtype, device_type: str,
                   target: Optional[Target] = None) -> AttentionConfig:
    """The config used without tuning, for `target` (None: the GPU torch sees). Every default compiles without
    spilling on sm_80, sm_90 and gfx942 (tests/codegen/test_kernels_compile.py)."""
    if device_type == "cpu":  # the interpreter: few, small programs keep numpy overhead low
        return AttentionConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    target = target if target is not None else current_target()
    padded = padded_head_dim(head_dim)
    if dtype == torch.float32:
        # IEEE fp32 dots run on FMA units (NVIDIA) and fp32 tiles are twice the bytes: small tiles, two stages.
        return AttentionConfig(block_m=32, block_n=16 if padded >= 128 else 64, num_warps=8, num_stages=2)
    if target is not None and target.backend == "hip":  # AMD's stream pipeliner double-buffers at 2 stages
        return AttentionConfig(block_m=128, block_n=32 if padded >= 128 else 64, num_warps=8 if padded >= 128 else 4,
                               num_stages=2)
    # 8 warps: with 4, a 64-wide head's 128x64 tiles use all 255 registers on sm_80 and spill with a window.
    return AttentionConfig(block_m=128, block_n=32 if padded >= 128 else 64, num_warps=8, num_stages=3)


def padded_head_dim(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16 and tiles are powers of two.
    return max(16, 1 << (int(head_dim) - 1).bit_length())


if HAS_TRITON:

    @triton.jit
    def _tile(
        acc, m_i, l_i, q,
        k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m_pos, offs_d, start_n, kv_end,
        qk_scale, window,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
        MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        d_ok = offs_d < HEAD_DIM
        n_ok = offs_n < kv_end
        k = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                    mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:  # fp32 inputs: full-precision products, not TF32
            qk = tl.dot(q, k, input_precision="ieee") * qk_scale
        else:
            qk = tl.dot(q, k) * qk_scale
        if MASKED:
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m_pos[:, None])
                if HAS_WINDOW:
                    visible = visible & (offs_n[None, :] > offs_m_pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids inf - inf = nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return acc, m_new, l_i

    @triton.jit
    def _attention_block(
        Q, K, V, Out, KVLen, pid_m, b, h,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        group, q_len, kv_len_max, q_offset, window, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KV_LEN: tl.constexpr, UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Rows [pid_m * BLOCK_M, +BLOCK_M) of query head h of sequence b: the whole FA2 forward for one tile."""
        kv_h = h // group

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_m_pos = offs_m + q_offset
        q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
        q_mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_base = K + b * stride_kb + kv_h * stride_kh
        v_base = V + b * stride_vb + kv_h * stride_vh

        kv_end = kv_len_max
        if HAS_KV_LEN:
            kv_end = tl.minimum(tl.load(KVLen + b).to(tl.int32), kv_len_max)

        first_pos = pid_m * BLOCK_M + q_offset
        last_pos = first_pos + BLOCK_M - 1
        # Key range any row of this block can see, and the part of it every row sees entirely.
        hi = kv_end
        full_hi = kv_end
        lo = 0
        full_lo = 0
        if CAUSAL:
            hi = tl.minimum(hi, last_pos + 1)
            full_hi = tl.minimum(full_hi, first_pos + 1)
            if HAS_WINDOW:
                lo = tl.maximum(0, first_pos - window + 1)
                full_lo = tl.maximum(0, last_pos - window + 1)
        hi = tl.maximum(hi, 0)
        # Tile-aligned boundaries: [lo_t, mid_lo) masked, [mid_lo, mid_hi) unmasked, [mid_hi, hi) masked.
        lo_t = (lo // BLOCK_N) * BLOCK_N
        mid_lo = tl.minimum(((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, hi)
        mid_hi = tl.maximum((full_hi // BLOCK_N) * BLOCK_N, mid_lo)
        mid_hi = tl.minimum(mid_hi, hi)
        mid_lo = tl.maximum(mid_lo, lo_t)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start_n in range(lo_t, mid_lo, BLOCK_N):
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                  offs_m_pos, offs_d, start_n, kv_end, qk_scale, window,
                                  HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_WINDOW, UPCAST, IEEE)
        for start_n in range(mid_lo, mid_hi, BLOCK_N):
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                  offs_m_pos, offs_d, start_n, kv_end, qk_scale, window,
                                  HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_WINDOW, UPCAST, IEEE)
        for start_n in range(mid_hi, hi, BLOCK_N):
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                  offs_m_pos, offs_d, start_n, kv_end, qk_scale, window,
                                  HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_WINDOW, UPCAST, IEEE)

        # Rows that saw no key have l = 0 and acc = 0: the contract's zeros.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_mask)

    @triton.jit
    def _attention_fwd(
        Q, K, V, Out, KVLen,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        num_heads, group, q_len, kv_len_max, q_offset, window, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KV_LEN: tl.constexpr, UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """GPUs: one program per tile, grid (row blocks, batch x heads)."""
        pid_bh = tl.program_id(1)
        _attention_block(Q, K, V, Out, KVLen, tl.program_id(0), pid_bh // num_heads, pid_bh % num_heads,
                         stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                         group, q_len, kv_len_max, q_offset, window, qk_scale,
                         HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_KV_LEN, UPCAST, IEEE)

    @triton.jit
    def _attention_fwd_persistent(
        Q, K, V, Out, KVLen,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        num_heads, batch_heads, group, q_len, kv_len_max, q_offset, window, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KV_LEN: tl.constexpr, UPCAST: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """triton-ascend: one program per core, each walking tiles pid, pid + programs, ... Row blocks vary
        fastest, so the long causal row blocks at a head's end are dealt round-robin rather than to one core."""
        row_blocks = tl.cdiv(q_len, BLOCK_M)
        for tile in range(tl.program_id(0), row_blocks * batch_heads, tl.num_programs(0)):
            bh = tile // row_blocks
            _attention_block(Q, K, V, Out, KVLen, tile % row_blocks, bh // num_heads, bh % num_heads,
                             stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                             stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                             group, q_len, kv_len_max, q_offset, window, qk_scale,
                             HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_KV_LEN, UPCAST, IEEE)


def _common_args(q, k, v, out, kv_len) -> tuple:
    """The runtime arguments both kernels share, up to (not including) the head counts."""
    return (q, k, v, out, kv_len if kv_len is not None else q,
            *q.stride(), *k.stride(), *v.stride(), *out.stride())


def _constexprs(q, kv_len, *, causal, window, block_m: int, block_n: int) -> dict:
    d = q.shape[-1]
    return dict(HEAD_DIM=d, BLOCK_D=padded_head_dim(d), BLOCK_M=block_m, BLOCK_N=block_n,
                CAUSAL=bool(causal), HAS_WINDOW=bool(causal) and int(window) > 0, HAS_KV_LEN=kv_len is not None,
                # The interpreter (cpu) has no bf16 arithmetic; fp32 inputs keep fp32 tiles and IEEE dots.
                UPCAST=q.device.type == "cpu" or q.dtype == torch.float32, IEEE=q.dtype == torch.float32)


def launch_args(q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0,
                config: Optional[AttentionConfig] = None) -> KernelLaunch:
    """The GPU kernel's launch for these inputs: one program per (row block, batch x head)."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    out = torch.empty((b, hq, sq, v.shape[-1]), dtype=q.dtype, device=q.device)
    config = config or default_config(d, q.dtype, q.device.type)
    args = (*_common_args(q, k, v, out, kv_len),
            hq, hq // hkv, sq, skv, int(q_offset), int(window), float(scale) * _LOG2E)
    return KernelLaunch(_attention_fwd, (triton.cdiv(sq, config.block_m), b * hq), args,
                        _constexprs(q, kv_len, causal=causal, window=window, block_m=config.block_m,
                                    block_n=config.block_n),
                        dict(num_warps=config.num_warps, num_stages=config.num_stages))


def persistent_launch_args(q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0, block_m: int,
                           block_n: int, programs: int, multibuffer: Optional[bool] = None) -> KernelLaunch:
    """The persistent kernel's launch: `programs` programs (triton-ascend: the core count) sharing all tiles.
    `multibuffer` is a triton-ascend compile option and is passed only when given."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    if programs < 1:
        raise ValueError(f"the persistent attention kernel needs at least one program, got {programs}")
    out = torch.empty((b, hq, sq, v.shape[-1]), dtype=q.dtype, device=q.device)
    args = (*_common_args(q, k, v, out, kv_len),
            hq, b * hq, hq // hkv, sq, skv, int(q_offset), int(window), float(scale) * _LOG2E)
    options = {} if multibuffer is None else {"multibuffer": bool(multibuffer)}
    return KernelLaunch(_attention_fwd_persistent, (int(programs),), args,
                        _constexprs(q, kv_len, causal=causal, window=window, block_m=block_m, block_n=block_n),
                        options)


def _output(launch: KernelLaunch) -> torch.Tensor:
    return launch.args[3]


def launch(q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0, config: Optional[AttentionConfig] = None):
    """Run the kernel with an explicit config (the autotuner's entry point)."""
    kernel_launch = launch_args(q, k, v, kv_len, causal=causal, scale=scale, q_offset=q_offset, window=window,
                                config=config)
    if _output(kernel_launch).numel():
        kernel_launch.run()
    return _output(kernel_launch)


def launch_persistent(q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0, block_m: int, block_n: int,
                      programs: int, multibuffer: Optional[bool] = None):
    """Run the persistent kernel (exact under TRITON_INTERPRET=1; on an NPU untested: no NPU was available)."""
    kernel_launch = persistent_launch_args(q, k, v, kv_len, causal=causal, scale=scale, q_offset=q_offset,
                                           window=window, block_m=block_m, block_n=block_n, programs=programs,
                                           multibuffer=multibuffer)
    if _output(kernel_launch).numel():
        kernel_launch.run()
    return _output(kernel_launch)


def _unsupported_reason(ctx, q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0) -> Optional[str]:
    if not HAS_TRITON:
        return "triton is not installed"
    if ctx.device_type == "cpu":
        if not (ctx.forced_provider == "triton" and ctx.triton_interpret):
            return "cpu tensors run Triton only under TRITON_INTERPRET=1 with provider='triton'"
    elif ctx.device_type == "npu":
        if ctx.forced_provider != "triton":
            return "on npu the persistent Triton kernel (triton-ascend, untested on hardware) runs only with " \
                   "provider='triton'"
    elif ctx.device_type != "cuda":
        return f"no Triton attention kernel for {ctx.device_type}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v are not 4-D"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} are not one of fp32/fp16/bf16"
    d = q.shape[-1]
    if not isinstance(d, int) or not isinstance(v.shape[-1], int):
        return "head dim is not static"
    if k.shape[-1] != d or v.shape[-1] != d:
        return "q, k and v head dims differ"
    if d > MAX_HEAD_DIM or d < 1:
        return f"head dim {d} is outside 1..{MAX_HEAD_DIM}"
    if kv_len is not None and (kv_len.dtype.is_floating_point or kv_len.dim() != 1):
        return "kv_len is not a 1-D integer tensor"
    if int(q_offset) < 0 or int(window) < 0:
        return "negative q_offset or window"
    if not math.isfinite(float(scale)):
        return "scale is not finite"
    return None


@register_lowering("attention", "triton", unsupported_reason=_unsupported_reason, priority=20)
def attention_triton(q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0, tuning_config=None):
    if q.device.type == "npu":
        config = tuning_config or _npu_default(q, k, v, kv_len, causal=causal, scale=scale, q_offset=q_offset,
                                               window=window)
        (programs,) = launch_grid(current_device())
        return launch_persistent(q, k, v, kv_len, causal=causal, scale=scale, q_offset=q_offset, window=window,
                                 block_m=config["block_m"], block_n=config["block_n"], programs=programs,
                                 multibuffer=config["multibuffer"])
    config = AttentionConfig(**tuning_config) if tuning_config else None
    return launch(q, k, v, kv_len, causal=causal, scale=scale, q_offset=q_offset, window=window, config=config)


def _npu_default(q, k, v, kv_len, **options) -> dict:
    """The triton-ascend space's default (attention_ascend registers it; ttftc.codegen.providers imports it)."""
    space = space_for("attention", "triton", "npu")
    if space is None:
        raise RuntimeError("the triton-ascend attention space is not registered: import "
                           "ttftc.codegen.triton.attention_ascend (ttftc.codegen.providers imports it)")
    return space.default(Problem.from_meta("attention", "triton", (q, k, v, kv_len), options))


def _space_rule(config: dict, problem: Problem) -> Optional[str]:
    q = problem.args[0]
    return prune_reason(config, q.shape[-1], q.dtype, q.shape[2], current_target())


def _space_default(problem: Problem) -> dict:
    q = problem.args[0]
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    return dataclasses.asdict(default_config(q.shape[-1], q.dtype, device))  # target None: the current GPU's


register_space(SearchSpace("attention", "triton", axes=TUNING_AXES, default=_space_default,
                           constraints=(_space_rule,)))
