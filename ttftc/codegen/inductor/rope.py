"""ttftc.rope for Inductor: the rotate-half decomposition, inlined, which Inductor fuses into one loop with the glue
around it (the op exists for the eager code generator, where the decomposition is six ATen calls)."""

from __future__ import annotations

from ttftc.codegen.inductor import inductor_reason
from ttftc.codegen.registry import register_lowering
from ttftc.ops.rope import rope_shape_reason, rotate_half_reference


def _rope_reason(ctx, x, cos, sin):
    return inductor_reason(ctx) or rope_shape_reason(x, cos, sin)


@register_lowering("rope", "inductor", unsupported_reason=_rope_reason, priority=100)
def rope_inductor(x, cos, sin):
    return rotate_half_reference(x, cos, sin)
