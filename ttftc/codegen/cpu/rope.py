"""CPU lowering of ttftc.rope: the native kernel (csrc/rope_kernel.h), one pass over x, into the op's layout.

fp32 and bf16, where the extension is built and the head dimension is innermost in memory; anything else (fp16,
no extension, a D-major layout) is the op's reference.
"""

from __future__ import annotations

from typing import Optional

from ttftc.codegen.cpu import _native
from ttftc.codegen.registry import register_lowering
from ttftc.ops.rope import empty_rope_output, rope_fake, rope_shape_reason


def rope_reason(ctx, x, cos, sin) -> Optional[str]:
    if ctx.device_type != "cpu":
        return f"cpu provider, tensors on {ctx.device_type}"
    reason = rope_shape_reason(x, cos, sin) or _native.rows_reason(x)
    if reason is None and any(t.stride(-1) != 1 for t in (x, cos, sin)):
        return "the head dimension is not innermost in memory"
    return reason


@register_lowering("rope", "cpu", unsupported_reason=rope_reason, fake=rope_fake)
def rope_cpu(x, cos, sin):
    return _native.rope(x, cos, sin, empty_rope_output(x, cos))
