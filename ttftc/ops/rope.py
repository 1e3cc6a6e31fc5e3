"""ttftc.rope: rotary position embedding of a query or key tensor in Hugging Face's rotate-half form.

    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

x is [B, H, S, D] (any strides); cos and sin broadcast to it without growing it ([B or 1, H or 1, S, D], as
`apply_rotary_pos_emb` unsqueezes them to [B, 1, S, D]), all three of one dtype. Decomposed, that is six ATen steps
over x (neg, cat, two muls, add, and the slices they read), each writing a tensor the size of x; fused it is one
read of x and one write of y.

y has the layout the decomposition gives it: dense, with its dimensions in the memory order of x's (a query sliced
out of a merged q|k|v GEMM output is [B, S, H, D] in memory, and so is its y). The graph after it was traced with
that layout, and views in it (a transpose and reshape of the attention output) only hold for it.

Numerics are the decomposition's: each product rounded to x's dtype, then the sum, so a 16-bit model sees the
same values as eager.
"""

from __future__ import annotations

import torch
from torch._prims_common import compute_elementwise_output_strides

from ttftc.ops.registry import define_op


def rope_shape_reason(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """None when (x, cos, sin) meet the op's contract, else what does not (metadata only)."""
    if x.dim() != 4:
        return f"x must be [B, H, S, D], got {x.dim()}-D"
    if x.shape[-1] % 2:
        return f"head dim {x.shape[-1]} is odd; rotate-half needs two halves"
    if not (x.dtype == cos.dtype == sin.dtype):
        return f"dtypes differ: x {x.dtype}, cos {cos.dtype}, sin {sin.dtype}"
    for name, table in (("cos", cos), ("sin", sin)):
        # Sizes compared as text: a symbolic sequence length must not pick up a guard here.
        if table.dim() != 4 or any(str(t) not in ("1", str(n)) for t, n in zip(table.shape[:2], x.shape[:2])) \
                or [str(t) for t in table.shape[2:]] != [str(n) for n in x.shape[2:]]:
            return f"{name} {tuple(table.shape)} does not broadcast to x {tuple(x.shape)} along B and H only"
    return None


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The decomposition, step by step as Hugging Face writes it (each step rounded to x's dtype)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_output_strides(x: torch.Tensor, cos: torch.Tensor) -> tuple:
    """y's strides: an elementwise op's over x and the broadcast cos, as the decomposition's first product has."""
    return tuple(compute_elementwise_output_strides(x, cos.expand(x.shape)))


def empty_rope_output(x: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """An uninitialised y in the decomposition's layout."""
    return torch.empty_strided(x.shape, rope_output_strides(x, cos), dtype=x.dtype, device=x.device)


def rope_fake(x, cos, sin):
    reason = rope_shape_reason(x, cos, sin)
    if reason is not None:
        raise ValueError(f"ttftc.rope: {reason}")
    return empty_rope_output(x, cos)


def _flops(x, cos, sin) -> int:
    return 0  # not GEMM-class work; the roofline counts GEMMs and attention only


@define_op("rope", fake=rope_fake, flops=_flops)
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The decomposition's own result differs from empty_rope_output only in strides of size-1 dimensions.
    return empty_rope_output(x, cos).copy_(rotate_half_reference(x, cos, sin))
