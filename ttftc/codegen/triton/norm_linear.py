"""Triton lowering of ttftc.norm_linear: the fused norm kernel (triton/norm.py) feeding one GEMM.

Design choice: a norm kernel that writes the normalised rows, then the vendor GEMM (cuBLAS through torch.mm),
rather than the norm as a GEMM prologue. Reasons, from the references (3.2, 3.3) rather than a GPU measurement
(none here): the prologue re-reads every x row once per N-tile to get its statistics before the first MAC, and
LayerNorm as a prologue needs E[x²] − E[x]² or a second pass; the separate norm costs one extra write and read of
a [T, H] tensor, which is O(T·H) against the GEMM's O(T·H·N) work (N = 3·H for merged q|k|v), and keeps the
GEMM on cuBLAS, which an untuned Triton GEMM does not beat. vLLM (fused_add_rms_norm, then the GEMM) and Liger
(a standalone rms_norm kernel) make the same split.
"""

from __future__ import annotations

from typing import Optional

import torch

from ttftc.codegen.registry import register_lowering
from ttftc.codegen.triton._ffn_norm_support import dtype_reason
from ttftc.codegen.triton.norm import fused_norm, norm_reason


def _reason(ctx, x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps) -> Optional[str]:
    reason = norm_reason(ctx, x, norm_w, norm_b, residual, kind=kind, eps=eps) or dtype_reason(w, b)
    if reason is not None:
        return reason
    if w.dim() != 2 or w.shape[1] != x.shape[-1]:
        return f"weight {tuple(w.shape)} does not fit hidden size {x.shape[-1]}"
    if w.dtype != torch.promote_types(x.dtype, norm_w.dtype):
        return f"weight dtype {w.dtype} differs from the normalised activations' dtype"
    return None


@register_lowering("norm_linear", "triton", unsupported_reason=_reason, priority=10)
def norm_linear_triton(x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps):
    normed, res_out = fused_norm(x, norm_w, norm_b, residual, kind=kind, eps=eps)
    out = torch.addmm(b, normed, w.t()) if b is not None else torch.mm(normed, w.t())
    return out.view(*x.shape[:-1], w.shape[0]), res_out
