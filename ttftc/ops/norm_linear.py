"""ttftc.norm_linear: (residual add →) RMSNorm or LayerNorm → linear, as one op.

Returns (out, residual_out). With a residual, residual_out = x + residual, the new residual stream that the
rest of the layer still reads. Without one, residual_out is an empty tensor that nothing reads: custom ops
cannot return an alias of an input, and a fixed arity keeps one schema.

q, k and v sharing one norm arrive here as one merged weight [Nq + Nk + Nv, H]; the pass splits `out` with views.

The RMSNorm numerics follow Hugging Face: statistics in fp32, the normalised activations cast back to the input
dtype, then scaled by the weight. Gemma's (1 + w) is folded into `norm_w` by the pass, at compile time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttftc.ops.registry import define_op

NORM_KINDS = ("rms", "layer")


def normalize(x, norm_w, norm_b, *, kind: str, eps: float) -> torch.Tensor:
    if kind == "rms":
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return norm_w * xf.to(x.dtype)
    if kind == "layer":
        return F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, eps)
    raise ValueError(f"Unknown norm kind {kind!r}; valid: {NORM_KINDS}")


def add_residual(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, that sum as the op's residual_out); without a residual, (x, an empty tensor)."""
    if residual is None:
        return x, x.new_empty(0)
    x = x + residual
    return x, x  # a fresh tensor, not an alias of an input, so the op may return it


def _fake(x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps):
    if kind not in NORM_KINDS:
        raise ValueError(f"Unknown norm kind {kind!r}; valid: {NORM_KINDS}")
    out = x.new_empty(x.shape[:-1] + (w.shape[0],), dtype=torch.promote_types(x.dtype, norm_w.dtype))
    res = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return out, res


def _flops(x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps) -> int:
    return 2 * (x.numel() // x.shape[-1]) * w.shape[0] * w.shape[1]


@define_op("norm_linear", fake=_fake, flops=_flops)
def norm_linear(
    x: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor | None,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    kind: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    x, residual_out = add_residual(x, residual)
    return F.linear(normalize(x, norm_w, norm_b, kind=kind, eps=eps), w, b), residual_out
