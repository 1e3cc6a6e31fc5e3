"""Regions of an aten graph: the nodes each repeated block of a model (a decoder layer) computes, and which
regions are the same computation on different weights.

A node belongs to block `model.layers.3` when its `nn_module_stack` (which survives AOTAutograd) passes through a
module whose path ends in an index, `<container>.<int>`: a ModuleList entry. A weight (a frozen get_attr) belongs
to the block all its users are in. Two blocks are the same region when their nodes, in graph order, have the same
ops, the same non-node arguments, the same shapes, dtypes and strides, and read the same values from outside
(the same outside node or the same position in the other block's inputs), and their weights have the same
shapes and dtypes. Values, never: those are the recipe's business (recipe.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from ttftc.passes._module_names import module_path

# The outermost `<name>.<int>` of a module path: a decoder layer, not an expert inside one.
_BLOCK = re.compile(r"^(?P<block>(?:.*?\.)?[A-Za-z_][A-Za-z0-9_]*\.\d+)(?:\.|$)")


@dataclass
class Block:
    """One repeated block's part of a graph."""

    name: str  # its module path, "model.layers.3"
    nodes: list[fx.Node]  # computing nodes, in graph order
    weights: list[fx.Node]  # the get_attr constants only it reads, in order of first use
    inputs: list[fx.Node] = field(default_factory=list)  # outside nodes it reads, in order of first read
    outputs: list[fx.Node] = field(default_factory=list)  # its nodes read outside it, in graph order
    signature: tuple = ()


def block_of(node: fx.Node) -> Optional[str]:
    path = module_path(node)
    if not path:
        return None
    match = _BLOCK.match(path)
    return match.group("block") if match else None


def find_blocks(gm: fx.GraphModule, skip_names: Sequence[str] = ()) -> tuple[list[Block], Optional[str]]:
    """The graph's repeated blocks, in graph order, or ([], why there are none worth splitting).

    `skip_names` are the Config.quant_skip fragments: a node whose module path holds one is compiled differently,
    so which fragments a node's path holds is part of its region's signature.
    """
    owner: dict[fx.Node, str] = {}
    order: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = block_of(node)
        if name is None:
            continue
        owner[node] = name
        if name not in order:
            order.append(name)
    if len(order) < 2:
        return [], "fewer than two repeated blocks (ModuleList entries) in the graph"
    blocks = {name: Block(name, [], []) for name in order}
    for node in gm.graph.nodes:
        if node in owner:
            blocks[owner[node]].nodes.append(node)
    # Contiguous blocks can be replaced by one call each, in place; interleaved ones cannot.
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    computing_before = [0]  # call_function nodes before each position: a block's span must hold only its own
    for n in nodes:
        computing_before.append(computing_before[-1] + (n.op == "call_function"))
    spans = sorted((position[b.nodes[0]], position[b.nodes[-1]], b.name) for b in blocks.values())
    for (_, end, name), (start, _, following) in zip(spans, spans[1:]):
        if start <= end:
            return [], f"blocks {name} and {following} interleave in the graph"
    for block in blocks.values():
        members = set(block.nodes)
        for node in block.nodes:
            for arg in node.all_input_nodes:
                if arg in members:
                    continue
                if arg.op == "get_attr" and all(u in members for u in arg.users):
                    if arg not in block.weights:
                        block.weights.append(arg)
                elif arg not in block.inputs:
                    block.inputs.append(arg)
        block.outputs = [n for n in block.nodes if any(u not in members for u in n.users)]
        start, end = position[block.nodes[0]], position[block.nodes[-1]]
        if computing_before[end + 1] - computing_before[start] != len(block.nodes):
            foreign = next(n for n in nodes[start:end] if n.op == "call_function" and n not in members)
            return [], f"block {block.name} has foreign node {foreign.name} inside its span"
        block.signature = _signature(gm, block, skip_names)
    return list(blocks.values()), None


def _describe_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(str(s) for s in value.shape), tuple(str(s) for s in value.stride()), value.dtype,
                value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_describe_value(v) for v in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(value))
    return ("value", repr(value))


def _signature(gm: fx.GraphModule, block: Block, skip_names: Sequence[str]) -> tuple:
    local = {n: ("node", i) for i, n in enumerate(block.nodes)}
    local.update({n: ("input", i) for i, n in enumerate(block.inputs)})
    local.update({n: ("weight", i) for i, n in enumerate(block.weights)})

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return local[a]
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in sorted(a.items())))
        if isinstance(a, torch.Tensor):
            return ("inline tensor", id(a))  # never equal across blocks: no reuse when a tensor sits in the args
        return ("value", repr(a))

    outputs = {n: i for i, n in enumerate(block.outputs)}
    parts: list[Any] = [("weights", tuple(_describe_value(w.meta.get("val")) for w in block.weights)),
                        ("inputs", tuple(_describe_value(i.meta.get("val")) for i in block.inputs))]
    for node in block.nodes:
        path = module_path(node) or ""
        parts.append((str(node.target), arg(node.args), arg(node.kwargs), _describe_value(node.meta.get("val")),
                      outputs.get(node), tuple(s for s in skip_names if s in path)))
    return tuple(parts)


def group_regions(blocks: list[Block]) -> list[list[Block]]:
    """Blocks grouped by signature, each group in graph order, groups in order of their first block."""
    groups: dict[tuple, list[Block]] = {}
    for block in blocks:
        groups.setdefault(block.signature, []).append(block)
    return list(groups.values())
