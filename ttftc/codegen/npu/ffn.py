"""Ascend NPU lowering of ttftc.gated_ffn: the merged gate|up matmul, torch_npu.npu_swiglu over its two halves
(silu(gate)·up in one vector kernel), then the down matmul.

Untested on hardware: checked only against the recording stand-in (tests/npu_standin.py).

npu_swiglu is SwiGLU only; GeGLU (gelu-tanh) has no fused op in the references, so it stays on the reference.
linear_act has no NPU-specific fusion either: the reference's linear + activation already run as NPU ops.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ttftc.codegen.registry import register_lowering
from ttftc.codegen.npu import _torch_npu

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _reason(ctx, x, w_gate_up, w_down, b_gate_up=None, b_down=None, *, act) -> Optional[str]:
    reason = _torch_npu.unsupported_device_reason(ctx)
    if reason is not None:
        return reason
    if act != "silu":
        return f"npu_swiglu covers silu only, not {act!r}"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} not supported by npu_swiglu"
    for t in (w_gate_up, w_down, b_gate_up, b_down):
        if t is not None and t.dtype != x.dtype:
            return f"weight or bias dtype {t.dtype} differs from activation dtype {x.dtype}"
    if w_gate_up.dim() != 2 or w_gate_up.shape[0] % 2 or w_gate_up.shape[1] != x.shape[-1]:
        return f"gate|up weight {tuple(w_gate_up.shape)} does not fit input width {x.shape[-1]}"
    if w_down.dim() != 2 or w_down.shape[1] * 2 != w_gate_up.shape[0]:
        return f"down weight {tuple(w_down.shape)} does not fit gate|up {tuple(w_gate_up.shape)}"
    return None


@register_lowering("gated_ffn", "npu", unsupported_reason=_reason, priority=5)
def gated_ffn_npu(x, w_gate_up, w_down, b_gate_up=None, b_down=None, *, act):
    torch_npu = _torch_npu.load()
    hidden = torch_npu.npu_swiglu(F.linear(x, w_gate_up, b_gate_up), dim=-1)
    return F.linear(hidden, w_down, b_down)
