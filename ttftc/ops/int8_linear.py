"""ttftc.int8_linear: W8A8 linear with dynamic per-token activation scales and per-channel weight scales.

x is either floating point (quantised here, per token, symmetric) or already int8 with `x_scale` [tokens]
from a producer that fused the quantisation. w_int8 is [N, K] int8 with w_scale [N] fp32. The int32
accumulator is dequantised with x_scale * w_scale, the bias is added, and the result is cast to out_dtype.
"""

from __future__ import annotations

import torch

from ttftc.ops.registry import define_op


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def operands_reason(x, x_scale, *weights_and_scales) -> str | None:
    """Why (x, x_scale, w, w_scale, ...) break the int8 ops' operand contract, or None.

    Device-independent, so every provider's capability check starts from it and adds only its own limits.
    """
    if x_scale is None and x.dtype not in FLOAT_DTYPES:
        return f"activation dtype {x.dtype} cannot be quantised"
    if x_scale is not None and x.dtype != torch.int8:
        return f"activation is {x.dtype} although a scale is given (want int8)"
    for w, s in zip(weights_and_scales[::2], weights_and_scales[1::2]):
        if w.dtype != torch.int8 or w.dim() != 2 or s.dim() != 1 or s.shape[0] != w.shape[0]:
            return f"weight {tuple(w.shape)} {w.dtype} / scale {tuple(s.shape)} is not int8 [N, K] with [N] scales"
    return None


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of the last dimension: returns (int8 values, fp32 scales of shape x.shape[:-1])."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=1e-8) / 127.0
    q = torch.round(xf / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, scale


def _fake(x, x_scale, w_int8, w_scale, bias=None, *, out_dtype):
    return torch.empty(x.shape[:-1] + (w_int8.shape[0],), dtype=out_dtype, device=x.device)


def _flops(x, x_scale, w_int8, w_scale, bias=None, *, out_dtype) -> int:
    return 2 * (x.numel() // x.shape[-1]) * w_int8.shape[0] * w_int8.shape[1]


@define_op("int8_linear", fake=_fake, flops=_flops)
def int8_linear(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    w_int8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    if x_scale is None:
        x, x_scale = quantize_per_token(x)
    lead = x.shape[:-1]
    # float64 keeps the int32 accumulation exact for any K a transformer uses, on every device.
    acc = x.reshape(-1, x.shape[-1]).double() @ w_int8.double().t()
    out = acc * x_scale.reshape(-1, 1).double() * w_scale.double().reshape(1, -1)
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype).reshape(*lead, w_int8.shape[0])
