"""Triton lowerings of W8A8: an int8 GEMM with int32 accumulation and the dequant epilogue, and per-token quantisation.

int8_gemm: out[M, N] = (Σ_k xq[m, k] · w[n, k]) · x_scale[m] · w_scale[n] + bias[n], cast to out's dtype in the
store. The accumulator is int32 (`tl.dot(..., out_dtype=tl.int32)`), exact for any K a transformer has; the
epilogue is fp32. The weight is read as [N, K] through its strides, so no transposed copy is needed.

quantize_rows: one program per row; a first sweep finds max |x|, a second writes round(x / scale) as int8.
Rounding is half away from zero (Triton has no round-half-even without libdevice, which the interpreter lacks),
so a value exactly halfway between two steps may land one step from torch.round's choice: within the op
contract's one-step tolerance.

gated_ffn_int8 composes them: gate|up GEMM (fp32 out) → act·mul in torch → quantize_rows → down GEMM.
Capable on CUDA, and on CPU only under TRITON_INTERPRET=1 with provider="triton" (how tests run the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ttftc.codegen.registry import register_lowering
from ttftc.codegen.triton._ffn_norm_support import HAS_TRITON, device_reason
from ttftc.codegen.triton.launch import KernelLaunch
from ttftc.ops.ffn import apply_activation
from ttftc.ops.int8_linear import operands_reason
from ttftc.ops.quant import gated_ffn_int8_reason

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _int8_gemm_kernel(
        a_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr,
        M, N, K,
        stride_am, stride_ak, stride_wn, stride_wk, stride_om, stride_on,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0)
            b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0)
            acc += tl.dot(a, b, out_dtype=tl.int32)
        x_scale = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
        w_scale = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
        out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on,
                 out.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_K)
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-8) / 127.0
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            v = x / scale
            v = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
            v = tl.minimum(tl.maximum(v, -127.0), 127.0)
            tl.store(q_ptr + row * stride_qm + k0 + cols, v.to(tl.int8), mask=k0 + cols < K)
        tl.store(s_ptr + row, scale)


@dataclass(frozen=True)
class Int8GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


GPU_CONFIG = Int8GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
# The interpreter simulates each program with numpy: few, large tiles are fastest and tl.dot needs >= 16.
INTERPRETER_CONFIG = Int8GemmConfig(block_m=32, block_n=32, block_k=32, num_warps=1, num_stages=1)
QUANTIZE_MAX_BLOCK = 1024


def int8_gemm_launch(xq: torch.Tensor, x_scale: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor,
                     bias: Optional[torch.Tensor], out: torch.Tensor) -> KernelLaunch:
    """x_scale and w_scale must already be contiguous fp32 (int8_gemm makes them so)."""
    m, k = xq.shape
    n = w_int8.shape[0]
    config = INTERPRETER_CONFIG if xq.device.type == "cpu" else GPU_CONFIG
    return KernelLaunch(
        _int8_gemm_kernel, (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n)),
        (xq, w_int8, x_scale, w_scale, bias if bias is not None else w_scale, out, m, n, k,
         xq.stride(0), xq.stride(1), w_int8.stride(0), w_int8.stride(1), out.stride(0), out.stride(1)),
        dict(HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k),
        dict(num_warps=config.num_warps, num_stages=config.num_stages),
    )


def int8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor,
              bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] int8, x_scale [M] fp32, w_int8 [N, K], w_scale [N] → [M, N] out_dtype."""
    m = xq.shape[0]
    out = torch.empty(m, w_int8.shape[0], dtype=out_dtype, device=xq.device)
    if m:
        int8_gemm_launch(xq, x_scale.reshape(-1).float().contiguous(), w_int8, w_scale.float().contiguous(), bias,
                         out).run()
    return out


def quantize_launch(x2d: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> KernelLaunch:
    m, k = x2d.shape
    return KernelLaunch(_quantize_rows_kernel, (m,), (x2d, q, scale, k, x2d.stride(0), q.stride(0)),
                        dict(BLOCK_K=min(QUANTIZE_MAX_BLOCK, triton.next_power_of_2(k))))


def quantize_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x2d.shape
    x2d = x2d if x2d.stride(1) == 1 else x2d.contiguous()
    q = torch.empty(m, k, dtype=torch.int8, device=x2d.device)
    scale = torch.empty(m, dtype=torch.float32, device=x2d.device)
    if m:
        quantize_launch(x2d, q, scale).run()
    return q, scale


def _rows(x: torch.Tensor, x_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x2d = x.reshape(-1, x.shape[-1])
    if x_scale is None:
        return quantize_rows(x2d)
    return x2d, x_scale.reshape(-1)


def _common_reason(ctx, x, x_scale, *weights_and_scales) -> Optional[str]:
    reason = device_reason(ctx)
    if reason is not None:
        return reason
    reason = operands_reason(x, x_scale, *weights_and_scales)
    if reason is not None:
        return reason
    for w in weights_and_scales[::2]:
        if w.shape[1] < 16:
            return f"K={w.shape[1]} below tl.dot's minimum of 16"
    return None


def _int8_linear_reason(ctx, x, x_scale, w_int8, w_scale, bias=None, *, out_dtype):
    reason = _common_reason(ctx, x, x_scale, w_int8, w_scale)
    if reason is None and out_dtype not in OUT_DTYPES:
        reason = f"out_dtype {out_dtype}"
    if reason is None and w_int8.shape[1] != x.shape[-1]:
        reason = f"weight {tuple(w_int8.shape)} does not fit input width {x.shape[-1]}"
    return reason


@register_lowering("int8_linear", "triton", unsupported_reason=_int8_linear_reason, priority=10)
def int8_linear_triton(x, x_scale, w_int8, w_scale, bias=None, *, out_dtype):
    xq, xs = _rows(x, x_scale)
    out = int8_gemm(xq, xs, w_int8, w_scale, bias, out_dtype)
    return out.view(*x.shape[:-1], w_int8.shape[0])


def _quantize_reason(ctx, x):
    return device_reason(ctx) or (None if x.dtype in OUT_DTYPES else f"dtype {x.dtype} cannot be quantised")


@register_lowering("quantize_per_token", "triton", unsupported_reason=_quantize_reason, priority=10)
def quantize_per_token_triton(x):
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return q.view(x.shape), scale.view(x.shape[:-1])


def _gated_reason(ctx, x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None, *,
                  act, out_dtype):
    reason = _common_reason(ctx, x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale)
    if reason is not None:
        return reason
    return gated_ffn_int8_reason(w_gate_up, w_down, act=act, out_dtype=out_dtype, out_dtypes=OUT_DTYPES)


@register_lowering("gated_ffn_int8", "triton", unsupported_reason=_gated_reason, priority=10)
def gated_ffn_int8_triton(x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None, *,
                          act, out_dtype):
    xq, xs = _rows(x, x_scale)
    gate_up = int8_gemm(xq, xs, w_gate_up, gate_up_scale, b_gate_up, torch.float32)
    gate, up = gate_up.chunk(2, dim=-1)
    hq, hs = quantize_rows(apply_activation(gate, act) * up)
    out = int8_gemm(hq, hs, w_down, down_scale, b_down, out_dtype)
    return out.view(*x.shape[:-1], w_down.shape[0])
