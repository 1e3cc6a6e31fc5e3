"""Triton lowerings of ttftc.gated_ffn and ttftc.linear_act: a GEMM with the activation in its epilogue.

gated_ffn: one kernel computes act(x·W_gateᵀ + b_g) · (x·W_upᵀ + b_u) tile by tile with two fp32 accumulators
that share every x tile (gate rows [0, I) and up rows [I, 2I) of the merged weight), so neither the [T, 2I]
gate|up tensor nor the activation's output is ever written; the down projection stays on the vendor GEMM, as
references 3.2 recommend (a single-kernel MLP was far slower in triton#1321).

linear_act: the same kernel with one accumulator: act(x·Wᵀ + b).

Activations are built from core Triton ops only (sigmoid, erf, exp-free tanh via sigmoid), never libdevice,
so the kernels also run under the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ttftc.codegen.registry import register_lowering
from ttftc.codegen.triton._ffn_norm_support import HAS_TRITON, device_reason, dtype_reason, interpreting
from ttftc.codegen.triton.launch import KernelLaunch
from ttftc.ops.ffn import ACTIVATIONS

ACT_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}  # silu 0, gelu_tanh 1, gelu 2, relu 3

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _activation(v, ACT: tl.constexpr):
        if ACT == 0:  # silu
            out = v * tl.sigmoid(v)
        elif ACT == 1:  # gelu, tanh approximation: tanh(z) = 2·sigmoid(2z) − 1
            z = 0.7978845608028654 * (v + 0.044715 * v * v * v)
            out = v * tl.sigmoid(2.0 * z)
        elif ACT == 2:  # gelu, exact
            out = 0.5 * v * (1.0 + tl.erf(v * 0.7071067811865476))
        else:  # relu
            out = tl.maximum(v, 0.0)
        return out

    @triton.jit
    def _gemm_act_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr,
        M, N, K, up_offset,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        n_mask = rn < N
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + rk) < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_tile = w_ptr + rn[None, :] * stride_wn + (k0 + rk)[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
            wkn_mask = k_mask[:, None] & n_mask[None, :]
            w_gate = tl.load(w_tile, mask=wkn_mask, other=0.0)
            if GATED:
                w_up = tl.load(w_tile + up_offset * stride_wn, mask=wkn_mask, other=0.0)
            if DOT_FP32:
                # fp32 GEMMs stay IEEE fp32 (not TF32), so fp32 models match eager as cuBLAS does by default.
                x = x.to(tl.float32)
                acc_gate += tl.dot(x, w_gate.to(tl.float32), input_precision="ieee")
                if GATED:
                    acc_up += tl.dot(x, w_up.to(tl.float32), input_precision="ieee")
            else:
                acc_gate += tl.dot(x, w_gate)
                if GATED:
                    acc_up += tl.dot(x, w_up)
        if HAS_BIAS:
            acc_gate += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(b_ptr + up_offset + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        result = _activation(acc_gate, ACT)
        if GATED:
            result = result * acc_up
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on,
                 result.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The GPU configs: the autotuner owns search spaces, and this kernel has none yet.
GPU_CONFIG = GemmConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
# fp32 runs IEEE dots on FMA units: the gated kernel's two 64x64 accumulators spill 476 B per thread on sm_80
# with 4 warps (`ttftc kernels --target sm_80`) and use all 254 registers with 8; 32-row tiles use 155-168.
GPU_CONFIG_FP32 = GemmConfig(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=3)


def gemm_config(m: int, n: int, k: int, interpret: bool, dtype: torch.dtype = torch.float16) -> GemmConfig:
    if interpret:  # every simulated program costs Python time: fewer, larger tiles for tiny test shapes
        return GemmConfig(max(16, min(64, triton.next_power_of_2(m))), max(16, min(64, triton.next_power_of_2(n))),
                          max(16, min(64, triton.next_power_of_2(k))), 4, 1)
    return GPU_CONFIG_FP32 if dtype == torch.float32 else GPU_CONFIG


def gemm_act_launch(x2d: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], out: torch.Tensor, *, act: str,
                    gated: bool) -> KernelLaunch:
    """act(x·W_gateᵀ + b_g)·(x·W_upᵀ + b_u) into out [M, N] when gated (w is [2N, K]), else act(x·Wᵀ + b)."""
    m, k = x2d.shape
    n = out.shape[1]
    interpret = interpreting(x2d)
    config = gemm_config(m, n, k, interpret, x2d.dtype)
    return KernelLaunch(
        _gemm_act_kernel, (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n)),
        (x2d, w, b if b is not None else w, out, m, n, k, n if gated else 0,
         x2d.stride(0), x2d.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1)),
        dict(HAS_BIAS=b is not None, GATED=gated, ACT=ACT_CODES[act], DOT_FP32=interpret or x2d.dtype == torch.float32,
             BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k),
        dict(num_warps=config.num_warps, num_stages=config.num_stages),
    )


def gemm_act(x2d: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], *, act: str, gated: bool) -> torch.Tensor:
    """act(x·W_gateᵀ + b_g)·(x·W_upᵀ + b_u) when gated (w is [2N, K]), else act(x·Wᵀ + b); out [M, N]."""
    m = x2d.shape[0]
    n = w.shape[0] // 2 if gated else w.shape[0]
    out = torch.empty(m, n, dtype=x2d.dtype, device=x2d.device)
    if m and n:
        gemm_act_launch(x2d, w, b, out, act=act, gated=gated).run()
    return out


def _common_reason(ctx, x, act, *tensors) -> Optional[str]:
    reason = device_reason(ctx) or dtype_reason(x, *tensors)
    if reason is not None:
        return reason
    if act not in ACT_CODES:
        return f"activation {act!r}"
    for t in tensors:
        if t is not None and t.dtype != x.dtype:
            return f"weight or bias dtype {t.dtype} differs from activation dtype {x.dtype}"
    return None


def _gated_reason(ctx, x, w_gate_up, w_down, b_gate_up=None, b_down=None, *, act) -> Optional[str]:
    reason = _common_reason(ctx, x, act, w_gate_up, w_down, b_gate_up, b_down)
    if reason is not None:
        return reason
    if w_gate_up.dim() != 2 or w_gate_up.shape[0] % 2 or w_gate_up.shape[1] != x.shape[-1]:
        return f"gate|up weight {tuple(w_gate_up.shape)} does not fit input width {x.shape[-1]}"
    if w_down.dim() != 2 or w_down.shape[1] * 2 != w_gate_up.shape[0]:
        return f"down weight {tuple(w_down.shape)} does not fit gate|up {tuple(w_gate_up.shape)}"
    return None


@register_lowering("gated_ffn", "triton", unsupported_reason=_gated_reason, priority=10)
def gated_ffn_triton(x, w_gate_up, w_down, b_gate_up=None, b_down=None, *, act):
    hidden = gemm_act(x.reshape(-1, x.shape[-1]), w_gate_up, b_gate_up, act=act, gated=True)
    out = torch.addmm(b_down, hidden, w_down.t()) if b_down is not None else torch.mm(hidden, w_down.t())
    return out.view(*x.shape[:-1], w_down.shape[0])


def _linear_act_reason(ctx, x, w, b=None, *, act) -> Optional[str]:
    reason = _common_reason(ctx, x, act, w, b)
    if reason is not None:
        return reason
    if w.dim() != 2 or w.shape[1] != x.shape[-1]:
        return f"weight {tuple(w.shape)} does not fit input width {x.shape[-1]}"
    return None


@register_lowering("linear_act", "triton", unsupported_reason=_linear_act_reason, priority=10)
def linear_act_triton(x, w, b=None, *, act):
    out = gemm_act(x.reshape(-1, x.shape[-1]), w, b, act=act, gated=False)
    return out.view(*x.shape[:-1], w.shape[0])
