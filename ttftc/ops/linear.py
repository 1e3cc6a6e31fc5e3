"""ttftc.linear: x · wᵀ (+ b) with a frozen weight stored [N, K], the GEMM no fused op took over.

A separate op (rather than leaving aten.mm in the graph) lets codegen pick the GEMM per device: on CPU the oneDNN
GEMM beats the BLAS that aten.mm calls (cpu/_blas.py has the numbers), while elsewhere the reference, F.linear,
already is the vendor GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttftc.ops.registry import define_op


def _fake(x, w, b=None):
    return x.new_empty(x.shape[:-1] + (w.shape[0],))


def _flops(x, w, b=None) -> int:
    return 2 * (x.numel() // x.shape[-1]) * w.shape[0] * w.shape[1]


@define_op("linear", fake=_fake, flops=_flops)
def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)
