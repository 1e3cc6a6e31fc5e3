"""A block as a graph of its own, with the context its passes need, and that context moved back out afterwards.

Some proofs need to see how a block's input was computed: the attention pass proves a mask causal by evaluating
the nodes that built it, which sit before the first block and are read by all of them. So an input that every
block of a region reads (the mask, the rotary tables) comes with a copy of the nodes that computed it from the
graph's inputs: its cone. After the passes and the lowering, whatever in the region still depends on nothing but
those graph inputs (the rotary tables the rope op reads; a mask no pass could remove) is moved back out, into the
outer graph, and computed once for all blocks instead of once per block; a mask the attention pass proved away
is simply gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ttftc.fx_utils import constant_value
from ttftc.regions.partition import Block

MAX_CONE = 256  # nodes copied per shared input: a mask or rotary table takes tens; more is not context


@dataclass
class Feed:
    """What one placeholder of a region receives: the block's own input at `position`, or the outer `node` (the
    same for every block of the region)."""

    position: Optional[int] = None
    node: Optional[fx.Node] = None

    def resolve(self, block: Block) -> fx.Node:
        return block.inputs[self.position] if self.position is not None else self.node


@dataclass
class Extracted:
    module: fx.GraphModule
    weights: list[torch.Tensor]  # the block's weights, as buffers w0, w1, ... (the recipe's sources)
    feeds: list[Feed]  # one per placeholder, in order


def extract(gm: fx.GraphModule, block: Block, shared: set[int], in_blocks: set[fx.Node]) -> Extracted:
    """`block` as a module: its inputs are placeholders, except those at `shared` positions (read by every block
    of its region), which come with their cone; its weights are buffers; its outputs one tuple."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    feeds: list[Feed] = []

    def placeholder(outer: fx.Node, feed: Feed) -> fx.Node:
        node = graph.placeholder(f"in_{len(feeds)}")
        node.meta.update(outer.meta)
        feeds.append(feed)
        env[outer] = node
        return node

    cones = {p: _cone(block.inputs[p], in_blocks) for p in sorted(shared)}
    copied = [n for n in gm.graph.nodes if any(n in cone for cone in cones.values() if cone)]
    for position, node in enumerate(block.inputs):
        if position in cones and not cones[position]:
            placeholder(node, Feed(node=node))  # the same node for every block of the region
        elif position not in cones:
            placeholder(node, Feed(position=position))
    for node in copied:
        for leaf in node.all_input_nodes:
            if leaf not in env and not any(leaf in cone for cone in cones.values() if cone):
                placeholder(leaf, Feed(node=leaf))
    root = torch.nn.Module()
    weights = []
    for i, node in enumerate(block.weights):
        tensor = constant_value(gm, node)
        if tensor is None:
            raise ValueError(f"{node.name} is not a constant of the graph")
        root.register_buffer(f"w{i}", tensor, persistent=False)
        weights.append(tensor)
        env[node] = graph.get_attr(f"w{i}")
        env[node].meta.update(node.meta)
    for node in copied + block.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in block.outputs))
    return Extracted(fx.GraphModule(root, graph), weights, feeds)


def _cone(node: fx.Node, in_blocks: set[fx.Node]) -> Optional[set[fx.Node]]:
    """The computing nodes `node` is made of, back to graph inputs, constants and block nodes (not included); None
    for a node that is itself one of those, or a cone too large to be context."""
    if node.op != "call_function" or node in in_blocks:
        return None
    cone: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in cone or n.op != "call_function" or n in in_blocks:
            continue
        if _mutates(n):
            return None
        cone.add(n)
        if len(cone) > MAX_CONE:
            return None
        stack.extend(n.all_input_nodes)
    return cone


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def hoist(outer: fx.GraphModule, extracted: Extracted, before: fx.Node) -> int:
    """Move what in the region depends only on shared outer nodes into `outer` (just before `before`), in place;
    the region reads the results as new placeholders. Returns how many region nodes now compute outside it."""
    sub = extracted.module
    placeholders = list(sub.graph.find_nodes(op="placeholder"))
    invariant = {p for p, feed in zip(placeholders, extracted.feeds) if feed.node is not None}
    for node in sub.graph.nodes:
        if node.op == "call_function" and not _mutates(node) and all(a in invariant for a in node.all_input_nodes):
            invariant.add(node)
    frontier = [n for n in sub.graph.nodes
                if n.op == "call_function" and n in invariant and any(u not in invariant for u in n.users)]
    if not frontier:
        return 0
    needed: set[fx.Node] = set()
    stack = list(frontier)
    while stack:
        node = stack.pop()
        if node in needed or node.op != "call_function":
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    env: dict[fx.Node, fx.Node] = {p: feed.node for p, feed in zip(placeholders, extracted.feeds)
                                   if feed.node is not None}
    with outer.graph.inserting_before(before):
        for node in sub.graph.nodes:  # graph order: every input is copied before its users
            if node in needed:
                env[node] = outer.graph.node_copy(node, lambda n: env[n])
    last = placeholders[-1] if placeholders else None
    for node in frontier:
        if last is None:
            with sub.graph.inserting_before(next(iter(sub.graph.nodes))):
                last = sub.graph.placeholder(f"in_{len(extracted.feeds)}")
        else:
            with sub.graph.inserting_after(last):
                last = sub.graph.placeholder(f"in_{len(extracted.feeds)}")
        last.meta.update(node.meta)
        extracted.feeds.append(Feed(node=env[node]))
        node.replace_all_uses_with(last)
    sub.graph.eliminate_dead_code()
    _drop_unused_placeholders(extracted)
    sub.graph.lint()
    sub.recompile()
    return len(needed)


def _drop_unused_placeholders(extracted: Extracted) -> None:
    placeholders = list(extracted.module.graph.find_nodes(op="placeholder"))
    kept = []
    for node, feed in zip(placeholders, extracted.feeds):
        if node.users:
            kept.append(feed)
        else:
            extracted.module.graph.erase_node(node)
    extracted.feeds[:] = kept
