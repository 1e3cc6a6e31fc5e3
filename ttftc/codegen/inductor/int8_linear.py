"""The W8A8 ops for Inductor: `torch._int_mm` for the int8 GEMMs, everything else aten.

On a CPU where `_int_mm` is not usable (ATen's plain loop without VNNI measured slower than fp32: see
codegen/cpu/int8_gemm_choice.py) these lowerings refuse, and Inductor calls the CPU lowerings as extern kernels.

Quantisation (the norm or activation that produces the int8 input, per-token scales), dequantisation (x_scale ·
w_scale, bias, the cast to the output dtype) and the act·mul of the gated FFN become loops Inductor fuses with each
other and with the glue around them; the reference's arithmetic is kept (fp32 statistics and scales, symmetric
rounding), so the numbers match the CPU lowerings up to one quantisation step on rounding ties.
"""

from __future__ import annotations

import torch

from ttftc.codegen.cpu.int8_linear import int8_gemm_choice
from ttftc.codegen.inductor import inductor_reason
from ttftc.codegen.registry import register_lowering
from ttftc.ops.ffn import apply_activation
from ttftc.ops.int8_linear import operands_reason, quantize_per_token
from ttftc.ops.norm_linear import NORM_KINDS, add_residual, normalize
from ttftc.ops.quant import gated_ffn_int8_reason

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _int_mm_reason(ctx) -> str | None:
    reason = inductor_reason(ctx) or (None if hasattr(torch, "_int_mm") else "this torch has no torch._int_mm")
    if reason is None and ctx.device_type == "cpu" and not int8_gemm_choice().usable("int_mm"):
        # The CPU lowering (called from Inductor's code as an extern kernel) runs the GEMM measured usable instead.
        return f"torch._int_mm is not the int8 GEMM for this CPU: {int8_gemm_choice().describe()}"
    return reason


def _rows(x: torch.Tensor, x_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    x2d = x.reshape(-1, x.shape[-1])
    if x_scale is None:
        return quantize_per_token(x2d)
    return x2d, x_scale.reshape(-1).float()


def _int8_gemm(xq, x_scale, w_int8, w_scale, bias, out_dtype):
    out = torch._int_mm(xq, w_int8.t()).float() * x_scale.unsqueeze(-1) * w_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _quantize_reason(ctx, x):
    return _int_mm_reason(ctx)


@register_lowering("quantize_per_token", "inductor", unsupported_reason=_quantize_reason, priority=100)
def quantize_per_token_inductor(x):
    return quantize_per_token(x)


def _norm_quant_reason(ctx, x, norm_w, norm_b=None, residual=None, *, kind, eps):
    return _int_mm_reason(ctx) or (None if kind in NORM_KINDS else f"norm kind {kind!r}")


@register_lowering("norm_quant", "inductor", unsupported_reason=_norm_quant_reason, priority=100)
def norm_quant_inductor(x, norm_w, norm_b=None, residual=None, *, kind, eps):
    x, residual_out = add_residual(x, residual)
    q, scale = quantize_per_token(normalize(x, norm_w, norm_b, kind=kind, eps=eps))
    return q, scale, residual_out


def _int8_linear_reason(ctx, x, x_scale, w_int8, w_scale, bias=None, *, out_dtype):
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype {out_dtype}"
    return _int_mm_reason(ctx) or operands_reason(x, x_scale, w_int8, w_scale)


@register_lowering("int8_linear", "inductor", unsupported_reason=_int8_linear_reason, priority=100)
def int8_linear_inductor(x, x_scale, w_int8, w_scale, bias=None, *, out_dtype):
    xq, xs = _rows(x, x_scale)
    out = _int8_gemm(xq, xs, w_int8, w_scale, bias, out_dtype)
    return out.reshape(*x.shape[:-1], w_int8.shape[0])


def _gated_reason(ctx, x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None, *,
                  act, out_dtype):
    return (_int_mm_reason(ctx) or operands_reason(x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale)
            or gated_ffn_int8_reason(w_gate_up, w_down, act=act, out_dtype=out_dtype, out_dtypes=OUT_DTYPES))


@register_lowering("gated_ffn_int8", "inductor", unsupported_reason=_gated_reason, priority=100)
def gated_ffn_int8_inductor(x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None,
                            *, act, out_dtype):
    xq, xs = _rows(x, x_scale)
    gate, up = _int8_gemm(xq, xs, w_gate_up, gate_up_scale, b_gate_up, torch.float32).chunk(2, dim=-1)
    hq, hs = quantize_per_token(apply_activation(gate, act) * up)
    out = _int8_gemm(hq, hs, w_down, down_scale, b_down, out_dtype)
    return out.reshape(*x.shape[:-1], w_down.shape[0])
