"""Names for explain and Config.quant_skip: the module path each graph node computes for.

Module names come from each node's `nn_module_stack`, which survives AOTAutograd on the mm/addmm of every
nn.Linear ("model.layers.0.mlp.down_proj", "lm_head"). Fused ttftc nodes are new and carry none, but their outputs
still feed the view nodes that followed the original linears, which keep theirs: a fused node is named by those
(a norm_linear feeding the lm_head is "lm_head"; a merged q/k/v projection is "...q_proj+...k_proj+...v_proj"; a
gated_ffn is "...mlp.down_proj").
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
import torch.fx as fx

from ttftc import fx_utils as gu

aten = torch.ops.aten


def _clean_path(path: str) -> str:
    # The compiled callable's own root: L['self'], or L['args'][0] when Dynamo saw the module as an argument.
    path = re.sub(r"^L\['[^']+'\](\[\d+\])?\.?", "", path)
    path = re.sub(r"\.?_modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".")


def module_path(node: fx.Node) -> Optional[str]:
    """The innermost module a node was traced in, as a dotted path ("model.layers.0.mlp.down_proj")."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, tuple) else path
    return _clean_path(str(path))


def _downstream_paths(node: fx.Node, depth: int = 5) -> list[str]:
    """Module paths of the first traced nodes downstream of `node` on each branch.

    A fused op's outputs still flow into the view nodes that followed the original linears, and those keep their
    `nn_module_stack` (the view after `mm` belongs to the nn.Linear), so they name the layers the op absorbed.
    """
    found: list[str] = []
    # Only the op's main output: a norm_linear's second output is the residual stream, read by the next layer.
    frontier, seen = list(gu.getitem_users(node).get(0, [])) or list(node.users), {node}
    for _ in range(depth):
        following = []
        for n in frontier:
            if n in seen or _feeds_gemm(n):
                continue  # a view that flattens the input of the *next* linear belongs to that linear
            seen.add(n)
            path = module_path(n)
            if path:
                found.append(path)
            else:
                following.extend(n.users)
        frontier = following
    # "model.layers.0" (the residual add) adds nothing next to "model.layers.0.mlp.down_proj".
    unique = sorted(set(found))
    return [p for p in unique if not any(o != p and o.startswith(p + ".") for o in unique)]


def _activation_input(node: fx.Node) -> Any:
    if gu.is_call(node, aten.mm.default):
        return node.args[0]
    if gu.is_call(node, aten.addmm.default):
        return node.args[1]
    if node.op == "call_function" and getattr(node.target, "namespace", None) == "ttftc" and node.args:
        return node.args[0]
    return None


def _feeds_gemm(node: fx.Node) -> bool:
    """A view whose user reads it as a GEMM's activation input (the flattening inside the next nn.Linear)."""
    return gu.is_call(node, *gu.VIEW_OPS) and any(_activation_input(u) is node for u in node.users)


def node_module_names(node: fx.Node) -> list[str]:
    """The module paths a node computes for: its own, or for a fused node the layers its outputs feed."""
    own = module_path(node)
    return [own] if own else _downstream_paths(node)


def describe(node: fx.Node, op_name: str) -> str:
    names = node_module_names(node)
    if module_path(node):
        return names[0]
    return f"{'+'.join(names) or '?'} ({op_name})"

