"""What a compiled graph runs: every GEMM and attention fused into a ttftc op and lowered to a provider's kernel.

Numbers alone cannot show this: an unfused graph (aten.mm, SDPA) or a ttftc op left on its reference computes the
same logits, only slower. Shared by the tests of graphs compiled in process and of graphs loaded from artifacts.
"""

from __future__ import annotations

from collections import Counter

import torch

from ttftc.codegen.providers import all_lowerings
from ttftc.ops.registry import op_name_of

aten = torch.ops.aten
# What a GEMM or an attention looks like when no pass fused it into a ttftc op.
UNFUSED = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._int_mm.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default, aten.scaled_dot_product_attention.default}


def lowered_ops(gm: torch.fx.GraphModule) -> Counter:
    """{(ttftc op, provider): calls} of the provider kernels the graph calls. Fails on a GEMM or attention left in
    aten form or on a ttftc op still calling its reference implementation."""
    kernels = {lowering.impl: (lowering.op, lowering.provider) for lowering in all_lowerings()}
    found: Counter = Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        assert op_name_of(node.target) is None, f"{node.name}: ttftc op {node.target} was not lowered"
        assert node.target not in UNFUSED, f"{node.name}: {node.target} was not fused into a ttftc op"
        if node.target in kernels:
            found[kernels[node.target]] += 1
    return found
