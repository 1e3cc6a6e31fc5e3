"""Ascend NPU lowering of ttftc.rope: torch_npu.npu_rotary_mul in its default "half" (rotate-half) mode.

Untested on hardware: checked only against the recording stand-in (tests/npu_standin.py).

The documented limits (torch_npu's npu_rotary_mul, A2/A3 with jit_compile=False) are checked here: x 4-D with an
even head dim below 896 and B, N below 1000; cos and sin shaped 11SD, B1SD or BNSD against a BNSD x. x goes in
contiguous (BNSD), and the result is copied into the op's layout when that differs (ttftc/ops/rope.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ttftc.codegen.registry import register_lowering
from ttftc.codegen.npu import _torch_npu
from ttftc.ops.rope import empty_rope_output, rope_fake, rope_shape_reason

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 896  # exclusive
MAX_BATCH_OR_HEADS = 1000  # exclusive


def rope_reason(ctx, x, cos, sin) -> Optional[str]:
    reason = _torch_npu.unsupported_device_reason(ctx) or rope_shape_reason(x, cos, sin)
    if reason is not None:
        return reason
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} not supported by npu_rotary_mul"
    b, h, _, d = x.shape
    if d >= MAX_HEAD_DIM:
        return f"head dim {d} is not below npu_rotary_mul's limit {MAX_HEAD_DIM}"
    if b >= MAX_BATCH_OR_HEADS or h >= MAX_BATCH_OR_HEADS:
        return f"batch {b} or heads {h} not below npu_rotary_mul's limit {MAX_BATCH_OR_HEADS}"
    for table in (cos, sin):
        if table.shape[1] != 1 and table.shape[1] != h:
            return f"cos/sin heads {table.shape[1]} are neither 1 nor {h}"
        if table.shape[1] == h and table.shape[0] != b:
            return "cos/sin with every head must have every batch row too (BNSD)"
    return None


@register_lowering("rope", "npu", unsupported_reason=rope_reason, priority=10, fake=rope_fake)
def rope_npu(x, cos, sin):
    y = _torch_npu.load().npu_rotary_mul(x.contiguous(), cos, sin)
    out = empty_rope_output(x, cos)
    return y if out.stride() == y.stride() else out.copy_(y)
