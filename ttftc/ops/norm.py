"""ttftc.norm: (residual add →) RMSNorm or LayerNorm on its own, for a norm whose consumer is not a plain linear.

The norm in front of a gated FFN feeds `ttftc.gated_ffn`, which owns its merged gate|up GEMM; fusing the norm
there too would give gated_ffn a second job. This op still turns the decomposed norm (pow, mean, add, rsqrt,
mul, mul: six passes over the activations) and the residual add before it into one fused step.

Returns (y, residual_out) with the same conventions and numerics as ttftc.norm_linear: residual_out = x +
residual when a residual is given, else an empty tensor nothing reads.
"""

from __future__ import annotations

import torch

from ttftc.ops.norm_linear import NORM_KINDS, add_residual, normalize
from ttftc.ops.registry import define_op


def _fake(x, norm_w, norm_b=None, residual=None, *, kind, eps):
    if kind not in NORM_KINDS:
        raise ValueError(f"Unknown norm kind {kind!r}; valid: {NORM_KINDS}")
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, norm_w.dtype))
    res = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return y, res


def _flops(x, norm_w, norm_b=None, residual=None, *, kind, eps) -> int:
    return 0  # not GEMM-class work; the roofline counts GEMMs and attention only


@define_op("norm", fake=_fake, flops=_flops)
def norm(
    x: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    kind: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    x, residual_out = add_residual(x, residual)
    return normalize(x, norm_w, norm_b, kind=kind, eps=eps), residual_out
