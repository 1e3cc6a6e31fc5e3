"""Ascend NPU lowerings of W8A8: torch_npu.npu_dynamic_quant (per-token activation quantisation) and
torch_npu.npu_quant_matmul (int8 GEMM with per-channel weight scale and per-token scale in its epilogue).

Untested on hardware: checked only against the recording stand-in (tests/npu_standin.py).

npu_quant_matmul takes the weight as x2 [K, N] (a transposed view of our [N, K]) and, with a per-token scale,
produces fp16 or bf16 only, so an fp32 out_dtype is a bf16 GEMM output widened afterwards. The bias is added
after the GEMM in the output dtype rather than passed to the op, whose accepted bias dtypes depend on the
output dtype and scale mode. npu_dynamic_quant is symmetric per token (scale = max|x| / 127), our contract.
"""

from __future__ import annotations

from typing import Optional

import torch

from ttftc.codegen.registry import register_lowering
from ttftc.codegen.npu import _torch_npu
from ttftc.codegen.npu.norm import norm_reason, npu_norm
from ttftc.ops.ffn import apply_activation
from ttftc.ops.int8_linear import operands_reason
from ttftc.ops.quant import gated_ffn_int8_reason

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NPU_OUT_DTYPES = (torch.float16, torch.bfloat16)


def dynamic_quant(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torch_npu = _torch_npu.load()
    # npu_dynamic_quant reads fp16/bf16; fp32 activations are narrowed to bf16 first (the scale is fp32 anyway).
    source = x2d if x2d.dtype in NPU_OUT_DTYPES else x2d.to(torch.bfloat16)
    q, scale = torch_npu.npu_dynamic_quant(source)
    return q, scale.reshape(-1)


def quant_matmul(xq, x_scale, w_int8, w_scale, bias, out_dtype) -> torch.Tensor:
    torch_npu = _torch_npu.load()
    npu_dtype = out_dtype if out_dtype in NPU_OUT_DTYPES else torch.bfloat16
    out = torch_npu.npu_quant_matmul(
        xq, w_int8.t(), w_scale.float(), pertoken_scale=x_scale.reshape(-1).float(), output_dtype=npu_dtype
    )
    out = out.to(out_dtype)
    return out + bias.to(out_dtype) if bias is not None else out


def _rows(x, x_scale) -> tuple[torch.Tensor, torch.Tensor]:
    x2d = x.reshape(-1, x.shape[-1])
    return dynamic_quant(x2d) if x_scale is None else (x2d, x_scale.reshape(-1))


def _reason(ctx, x, x_scale, *weights_and_scales) -> Optional[str]:
    reason = _torch_npu.unsupported_device_reason(ctx)
    if reason is not None:
        return reason
    return operands_reason(x, x_scale, *weights_and_scales)


def _int8_linear_reason(ctx, x, x_scale, w_int8, w_scale, bias=None, *, out_dtype):
    reason = _reason(ctx, x, x_scale, w_int8, w_scale)
    if reason is None and out_dtype not in ACT_DTYPES:
        reason = f"out_dtype {out_dtype}"
    return reason


@register_lowering("int8_linear", "npu", unsupported_reason=_int8_linear_reason, priority=20)
def int8_linear_npu(x, x_scale, w_int8, w_scale, bias=None, *, out_dtype):
    xq, xs = _rows(x, x_scale)
    return quant_matmul(xq, xs, w_int8, w_scale, bias, out_dtype).view(*x.shape[:-1], w_int8.shape[0])


def _quantize_reason(ctx, x):
    return _reason(ctx, x, None)


@register_lowering("quantize_per_token", "npu", unsupported_reason=_quantize_reason, priority=20)
def quantize_per_token_npu(x):
    q, scale = dynamic_quant(x.reshape(-1, x.shape[-1]))
    return q.view(x.shape), scale.view(x.shape[:-1])


def _norm_quant_reason(ctx, x, norm_w, norm_b=None, residual=None, *, kind, eps):
    return _reason(ctx, x, None) or norm_reason(ctx, x, norm_w, norm_b, residual, kind=kind, eps=eps)


@register_lowering("norm_quant", "npu", unsupported_reason=_norm_quant_reason, priority=20)
def norm_quant_npu(x, norm_w, norm_b=None, residual=None, *, kind, eps):
    y, residual_out = npu_norm(x, norm_w, norm_b, residual, kind=kind, eps=eps)
    q, scale = dynamic_quant(y.reshape(-1, y.shape[-1]))
    return q.view(y.shape), scale.view(y.shape[:-1]), residual_out


def _gated_reason(ctx, x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None, *,
                  act, out_dtype):
    reason = _reason(ctx, x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale)
    if reason is not None:
        return reason
    return gated_ffn_int8_reason(w_gate_up, w_down, act=act, out_dtype=out_dtype, out_dtypes=ACT_DTYPES)


@register_lowering("gated_ffn_int8", "npu", unsupported_reason=_gated_reason, priority=20)
def gated_ffn_int8_npu(x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None, *,
                       act, out_dtype):
    torch_npu = _torch_npu.load()
    xq, xs = _rows(x, x_scale)
    gate_up = quant_matmul(xq, xs, w_gate_up, gate_up_scale, b_gate_up, torch.bfloat16)
    if act == "silu":
        h = torch_npu.npu_swiglu(gate_up, dim=-1)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        h = apply_activation(gate, act) * up
    hq, hs = dynamic_quant(h)
    out = quant_matmul(hq, hs, w_down, down_scale, b_down, out_dtype)
    return out.view(*x.shape[:-1], w_down.shape[0])
