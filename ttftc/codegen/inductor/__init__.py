"""Lowerings for the Inductor code generator: each op as the graph Inductor should see, not an opaque kernel.

Under `codegen="inductor"` an op whose work is mostly glue (norms, residual adds, activations, quantisation and
dequantisation) is inlined as its decomposition: the GEMMs stay ttftc ops (`ttftc.linear`, lowered next to the
oneDNN or Triton GEMM as an extern kernel) or `torch._int_mm` (which Inductor lowers itself), and everything
between them is aten that Inductor fuses with the glue around it, into one loop per fusion group instead of one
ATen call per elementwise step. Attention and plain linears have no decomposition here: they reach Inductor as their
CPU or Triton lowering's extern op.

Every lowering here is capable only when the graph goes to Inductor (LoweringContext.codegen == "inductor"), on a
device Inductor generates code for.
"""

from __future__ import annotations

from typing import Optional

INDUCTOR_DEVICES = ("cpu", "cuda")


def inductor_reason(ctx) -> Optional[str]:
    """None when a decomposition may be inlined for this lowering context, else why not."""
    if ctx.codegen != "inductor":
        return "inlined only for the Inductor code generator"
    if ctx.device_type not in INDUCTOR_DEVICES:
        return f"Inductor does not generate code for {ctx.device_type}"
    return None
