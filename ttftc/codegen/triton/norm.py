"""Triton lowering of ttftc.norm: one kernel for the residual add and RMSNorm/LayerNorm, one row per program.

Each program loads one row (and its residual), adds, stores the new residual, computes the statistics in fp32
and stores the scaled row. RMSNorm follows Hugging Face's numerics: x * rstd is rounded to the input dtype
before the weight multiply. The whole row lives in one block, so hidden sizes up to MAX_HIDDEN are supported;
wider rows fall back to the reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from ttftc.codegen.registry import register_lowering
from ttftc.codegen.triton._ffn_norm_support import HAS_TRITON, device_reason, dtype_reason
from ttftc.codegen.triton.launch import KernelLaunch

MAX_HIDDEN = 16384

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_kernel(
        x_ptr, res_ptr, res_out_ptr, w_ptr, b_ptr, y_ptr,
        hidden, stride_x, stride_res, stride_res_out, stride_y, eps,
        HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x_in = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        x = x_in.to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
            # The sum is rounded to the stream dtype, as the unfused add would store it, before the norm reads it.
            summed = (x + r).to(x_in.dtype)
            tl.store(res_out_ptr + row * stride_res_out + cols, summed, mask=mask)
            x = summed.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
            normed = (x * rstd).to(x_in.dtype).to(tl.float32)
            y = normed * w
        else:
            mean = tl.sum(x, axis=0) / hidden
            centred = tl.where(mask, x - mean, 0.0)
            rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / hidden + eps)
            y = centred * rstd * w
            if HAS_BIAS:
                y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def norm_reason(ctx, x, norm_w, norm_b=None, residual=None, *, kind, eps) -> Optional[str]:
    reason = device_reason(ctx) or dtype_reason(x, norm_w, norm_b, residual)
    if reason is not None:
        return reason
    if kind not in ("rms", "layer"):
        return f"norm kind {kind!r}"
    hidden = x.shape[-1]
    if norm_w.dim() != 1 or norm_w.shape[0] != hidden:
        return f"norm weight shape {tuple(norm_w.shape)} does not match hidden size {hidden}"
    if hidden > MAX_HIDDEN:
        return f"hidden size {hidden} exceeds the one-block norm kernel's limit {MAX_HIDDEN}"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return "residual shape or dtype differs from the input"
    return None


def norm_warps(block: int) -> int:
    """Warps for a row of BLOCK elements: at most 32 fp32 elements per thread, so the row, its residual and
    the weight stay in registers (four warps for every row up to 4096 wide; 16 for 16384)."""
    return max(4, min(16, block // 1024))


def norm_launch(x2: torch.Tensor, r2: torch.Tensor, res_out2: torch.Tensor, norm_w, norm_b, y: torch.Tensor, *,
                has_residual: bool, kind: str, eps: float) -> KernelLaunch:
    """The kernel's launch over 2-D rows (one program per row); r2/res_out2 are ignored unless has_residual."""
    rows, hidden = x2.shape
    block = triton.next_power_of_2(hidden)
    return KernelLaunch(
        _norm_kernel, (rows,),
        (x2, r2, res_out2, norm_w, norm_b if norm_b is not None else norm_w, y,
         hidden, x2.stride(0), r2.stride(0), res_out2.stride(0), y.stride(0), float(eps)),
        dict(HAS_RESIDUAL=has_residual, HAS_BIAS=norm_b is not None, IS_RMS=kind == "rms", BLOCK=block),
        dict(num_warps=norm_warps(block)),
    )


def fused_norm(x: torch.Tensor, norm_w, norm_b, residual, *, kind: str, eps: float):
    """(y [rows, H], residual_out) for x of any leading shape; y is 2-D, the callers reshape."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, hidden, dtype=torch.promote_types(x.dtype, norm_w.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out2 = res_out.view(-1, hidden)
    else:
        r2, res_out, res_out2 = x2, x.new_empty(0), x2
    if rows:
        norm_launch(x2, r2, res_out2, norm_w, norm_b, y, has_residual=residual is not None, kind=kind,
                    eps=eps).run()
    return y, res_out


@register_lowering("norm", "triton", unsupported_reason=norm_reason, priority=10)
def norm_triton(x, norm_w, norm_b=None, residual=None, *, kind, eps):
    y, res_out = fused_norm(x, norm_w, norm_b, residual, kind=kind, eps=eps)
    return y.view(x.shape), res_out
