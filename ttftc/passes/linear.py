"""The linear pass: each frozen-weight GEMM still left as aten.mm / aten.addmm becomes ttftc.linear.

It runs last, so it only sees the linears no fusion took (o_proj, GPT-2's c_attn and c_proj, an lm_head kept out of
int8), in whatever dtype the precision pass left them. The op changes no numerics by itself; it lets codegen choose
the GEMM per device (see ttftc/ops/linear.py).

The guard proves: the weight (and bias) are frozen constants of the activation's dtype and the shapes agree.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.fx as fx

from ttftc import fx_utils as gu
from ttftc.passes._linear import LinearMatch, copy_provenance, match_linear
from ttftc.passes.base import GraphPass

aten = torch.ops.aten
_GEMMS = (aten.mm.default, aten.addmm.default)


class LinearPass(GraphPass):
    name = "linear"

    def find(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _GEMMS]

    def guard(self, gm: fx.GraphModule, node: fx.Node) -> Optional[str]:
        match = match_linear(gm, node)
        if match is None:
            return f"{node.name}: not a linear with a frozen 2-D weight (and bias)"
        x_dtype = gu.val(match.x).dtype
        if match.weight.dtype != x_dtype or (match.bias is not None and match.bias.dtype != x_dtype):
            return f"{node.name}: weight/bias dtype differs from activation dtype {x_dtype}"
        if match.weight.shape[1] != gu.val(match.x).shape[-1]:
            return f"{node.name}: weight {tuple(match.weight.shape)} does not fit the activations"
        return None

    def replace(self, gm: fx.GraphModule, node: fx.Node) -> None:
        match: LinearMatch = match_linear(gm, node)
        with gm.graph.inserting_before(node):
            # Conv1D stores [K, N]: hand the op a transposed view of it rather than a copy.
            w = match.weight_node or gu.call(gm, aten.permute.default, (node.args[-1], [1, 0]))
            new = gu.call(gm, torch.ops.ttftc.linear.default, (match.x, w, match.bias_node))
        if not gu.tensor_meta_matches(new.meta["val"], node.meta["val"]):
            raise RuntimeError(f"linear replacement changed {node.name}'s shape or dtype")
        copy_provenance(new, node)
        node.replace_all_uses_with(new)
