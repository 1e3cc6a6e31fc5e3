"""ttftc.norm and ttftc.norm_linear for Inductor: the norm (and the residual add before it) as aten, which
Inductor fuses into one loop with what surrounds it, and the GEMM as ttftc.linear."""

from __future__ import annotations

import torch

from ttftc.codegen.inductor import inductor_reason
from ttftc.codegen.registry import register_lowering
from ttftc.ops.norm_linear import NORM_KINDS, add_residual, normalize


def _norm_reason(ctx, x, norm_w, norm_b=None, residual=None, *, kind, eps):
    return inductor_reason(ctx) or (None if kind in NORM_KINDS else f"norm kind {kind!r}")


@register_lowering("norm", "inductor", unsupported_reason=_norm_reason, priority=100)
def norm_inductor(x, norm_w, norm_b=None, residual=None, *, kind, eps):
    x, residual_out = add_residual(x, residual)
    return normalize(x, norm_w, norm_b, kind=kind, eps=eps), residual_out


def _norm_linear_reason(ctx, x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps):
    return _norm_reason(ctx, x, norm_w, norm_b, residual, kind=kind, eps=eps)


@register_lowering("norm_linear", "inductor", unsupported_reason=_norm_linear_reason, priority=100)
def norm_linear_inductor(x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps):
    normed, residual_out = norm_inductor(x, norm_w, norm_b, residual, kind=kind, eps=eps)
    return torch.ops.ttftc.linear(normed, w, b), residual_out
