"""Ascend NPU lowering of ttftc.norm: torch_npu.npu_rms_norm, or npu_add_rms_norm when a residual is fused.

Untested on hardware: checked only against the recording stand-in (tests/npu_standin.py).

torch_npu applies gamma in fp32 before rounding to the input dtype, one rounding fewer than Hugging Face's
bf16 RMSNorm (which rounds x·rstd first); the difference is at most one bf16 ulp per element. LayerNorm has no
fused residual variant in the references, so it is the native layer_norm after a plain add.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ttftc.codegen.registry import register_lowering
from ttftc.codegen.npu import _torch_npu

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def norm_reason(ctx, x, norm_w, norm_b=None, residual=None, *, kind, eps) -> Optional[str]:
    reason = _torch_npu.unsupported_device_reason(ctx)
    if reason is not None:
        return reason
    if kind not in ("rms", "layer"):
        return f"norm kind {kind!r}"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} not supported by npu_rms_norm"
    if norm_w.dim() != 1 or norm_w.shape[0] != x.shape[-1]:
        return f"norm weight shape {tuple(norm_w.shape)} does not match hidden size {x.shape[-1]}"
    if norm_w.dtype != x.dtype:
        return f"gamma dtype {norm_w.dtype} differs from input dtype {x.dtype}"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return "residual shape or dtype differs from the input"
    return None


def npu_norm(x, norm_w, norm_b, residual, *, kind: str, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual_out) with the op contract's conventions."""
    torch_npu = _torch_npu.load()
    if kind == "rms":
        if residual is not None:
            y, _rstd, summed = torch_npu.npu_add_rms_norm(x, residual, norm_w, epsilon=eps)
            return y, summed
        y, _rstd = torch_npu.npu_rms_norm(x, norm_w, epsilon=eps)
        return y, x.new_empty(0)
    residual_out = x.new_empty(0)
    if residual is not None:
        x = residual_out = x + residual
    return F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, eps), residual_out


@register_lowering("norm", "npu", unsupported_reason=norm_reason, priority=5)
def norm_npu(x, norm_w, norm_b=None, residual=None, *, kind, eps):
    return npu_norm(x, norm_w, norm_b, residual, kind=kind, eps=eps)
