"""The producer halves of W8A8: ops that end by quantising their output per token, for ttftc.int8_linear to read.

quantize_per_token: symmetric int8 per token of any float tensor, one producer shared by several int8 GEMMs
                 that read the same activations (q, k and v projections left unmerged).
norm_quant:      (residual add →) RMSNorm or LayerNorm → symmetric int8 per token. Returns (q, scale, residual_out)
                 with q int8 shaped like x, scale fp32 shaped x.shape[:-1], and residual_out following
                 ttftc.norm_linear's convention (x + residual with a residual, else an empty tensor).
gated_ffn_int8:  the whole gated FFN in W8A8: int8 gate|up GEMM → dequant → act(gate)·up → quantise per token
                 (the act·mul epilogue) → int8 down GEMM → dequant to out_dtype. x is float (quantised here) or
                 int8 with x_scale from a producer that fused the quantisation.

Weights are int8 [N, K] with fp32 per-output-channel scales [N], as in ttftc.int8_linear. The references below
are the numerics contract; lowerings must match them up to int8 rounding ties (one quantisation step).
"""

from __future__ import annotations

import torch

from ttftc.ops.ffn import ACTIVATIONS, apply_activation
from ttftc.ops.int8_linear import int8_linear as _int8_linear_op
from ttftc.ops.int8_linear import quantize_per_token
from ttftc.ops.norm_linear import NORM_KINDS, add_residual, normalize
from ttftc.ops.registry import define_op


def _quantize_fake(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _no_flops(*args, **kwargs) -> int:
    return 0  # elementwise and reductions: not GEMM-class work


@define_op("quantize_per_token", fake=_quantize_fake, flops=_no_flops)
def quantize_per_token_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token(x)


def _norm_quant_fake(x, norm_w, norm_b=None, residual=None, *, kind, eps):
    if kind not in NORM_KINDS:
        raise ValueError(f"Unknown norm kind {kind!r}; valid: {NORM_KINDS}")
    q = x.new_empty(x.shape, dtype=torch.int8)
    scale = x.new_empty(x.shape[:-1], dtype=torch.float32)
    res = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return q, scale, res


@define_op("norm_quant", fake=_norm_quant_fake, flops=_no_flops)
def norm_quant(
    x: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    kind: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, residual_out = add_residual(x, residual)
    q, scale = quantize_per_token(normalize(x, norm_w, norm_b, kind=kind, eps=eps))
    return q, scale, residual_out


def gated_ffn_int8_reason(w_gate_up, w_down, *, act: str, out_dtype, out_dtypes) -> str | None:
    """Why gated_ffn_int8's weights, activation or output dtype are not a gated FFN a provider can run, or None."""
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    if out_dtype not in out_dtypes:
        return f"out_dtype {out_dtype}"
    if w_gate_up.shape[0] % 2 or w_gate_up.shape[0] // 2 != w_down.shape[1]:
        return f"weights {tuple(w_gate_up.shape)} / {tuple(w_down.shape)} do not form a gated FFN"
    return None


def act_mul_quant(gate_up: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(gate) * up over the halves of the last dimension, quantised per token (fp32 math)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return quantize_per_token(apply_activation(gate, act) * up)


def _gated_fake(x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None, *, act,
                out_dtype):
    if act not in ACTIVATIONS:
        raise ValueError(f"Unknown activation {act!r}; valid: {ACTIVATIONS}")
    return x.new_empty(x.shape[:-1] + (w_down.shape[0],), dtype=out_dtype)


def _gated_flops(x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None, *, act,
                 out_dtype) -> int:
    tokens = x.numel() // x.shape[-1]
    return 2 * tokens * (w_gate_up.shape[0] * w_gate_up.shape[1] + w_down.shape[0] * w_down.shape[1])


@define_op("gated_ffn_int8", fake=_gated_fake, flops=_gated_flops)
def gated_ffn_int8(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    w_gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    w_down: torch.Tensor,
    down_scale: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    *,
    act: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    gate_up = _int8_linear_op.reference(x, x_scale, w_gate_up, gate_up_scale, b_gate_up, out_dtype=torch.float32)
    h, h_scale = act_mul_quant(gate_up, act)
    return _int8_linear_op.reference(h, h_scale, w_down, down_scale, b_down, out_dtype=out_dtype)
