"""Ascend NPU lowering of ttftc.norm_linear: npu_rms_norm / npu_add_rms_norm, then one matmul into the merged
weight (the NPU's cube unit through torch.nn.functional.linear).

Untested on hardware: checked only against the recording stand-in (tests/npu_standin.py).
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F

from ttftc.codegen.registry import register_lowering
from ttftc.codegen.npu.norm import norm_reason, npu_norm


def _reason(ctx, x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps) -> Optional[str]:
    reason = norm_reason(ctx, x, norm_w, norm_b, residual, kind=kind, eps=eps)
    if reason is not None:
        return reason
    if w.dim() != 2 or w.shape[1] != x.shape[-1] or w.dtype != x.dtype:
        return f"weight {tuple(w.shape)} / {w.dtype} does not fit input [.., {x.shape[-1]}] / {x.dtype}"
    return None


@register_lowering("norm_linear", "npu", unsupported_reason=_reason, priority=5)
def norm_linear_npu(x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps):
    normed, residual_out = npu_norm(x, norm_w, norm_b, residual, kind=kind, eps=eps)
    return F.linear(normed, w, b), residual_out
