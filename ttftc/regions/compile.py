"""Regional compilation of one frozen aten graph: each distinct repeated block runs the passes and the lowering
once; every other block of the same region reuses that compiled code with its own weights.

    blocks (partition.py)  →  one region per signature  →  compile the first block of each region, recording how
    its constants came from its weights (recipe.py)  →  for each other block, replay the recipe on its weights and
    bind the results to the same compiled code  →  each block becomes one call of its region's module in the outer
    graph, which then runs the pipeline itself (embedding, final norm, lm_head).

A region whose recording cannot prove replay safe (a pass read a weight's values, a constant of unseen origin)
compiles each of its blocks on its own, as a compile without regions would. The Report merges every block's
report, so pass counts and op histograms read as for the whole model, and says how many regions there were.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ttftc.config import Config
from ttftc.fx_utils import constant_value
from ttftc.pipeline import run_pipeline
from ttftc.regions.extract import Feed, extract, hoist
from ttftc.regions.partition import Block, find_blocks, group_regions
from ttftc.regions.recipe import ReplayMismatch, WeightRecipe, WeightRecorder, recipe_for
from ttftc.report import Report

REGION_PREFIX = "_ttftc_region_"


@dataclass
class RegionStats:
    """What regional compilation did, for the report and for tests."""

    regions: int = 0  # distinct regions (signatures)
    blocks: int = 0  # blocks found
    full_compiles: int = 0  # blocks that ran the passes and the lowering
    reused: int = 0  # blocks bound to another block's compiled code
    replayed_calls: int = 0  # recorded weight transforms replayed, all blocks together


def bind(compiled: fx.GraphModule, buffers: dict[str, torch.Tensor]) -> fx.GraphModule:
    """A module running `compiled`'s code (the same class, graph and generated forward) on other buffers."""
    clone = object.__new__(type(compiled))  # GraphModule.__new__ would make a class of its own, without forward
    clone.__dict__.update(compiled.__dict__)
    clone.__dict__["_buffers"] = {**compiled._buffers, **buffers}
    return clone


def reuse_blocker(gm: fx.GraphModule) -> Optional[str]:
    """None when everything `gm` computes with beyond its inputs is a buffer read through get_attr (what `bind`
    swaps), else what would stay shared between blocks."""
    if gm._modules:
        return f"the compiled region holds submodules ({', '.join(gm._modules)})"
    if gm._parameters:
        return "the compiled region holds parameters"
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in gm._buffers:
            return f"{node.target} is an attribute, not a buffer"
        leaves = torch.utils._pytree.tree_leaves((node.args, node.kwargs))
        if any(isinstance(x, torch.Tensor) for x in leaves):
            return f"{node.name} holds a tensor in its arguments"
        if node.op == "call_function" and _holds_tensor(node.target):
            return f"{node.name}'s target holds a tensor"
    return None


def _holds_tensor(target) -> bool:
    """Whether a call target carries a tensor of its own: in its attributes, a partial's bound arguments, or a
    closure (a lowering that captured a weight would keep computing with the first block's)."""
    held = list(getattr(target, "__dict__", {}).values())
    if isinstance(target, functools.partial):
        held += [target.func, *target.args, *target.keywords.values()]
    held += [cell.cell_contents for cell in (getattr(target, "__closure__", None) or ()) if _filled(cell)]
    return any(isinstance(x, torch.Tensor) for x in torch.utils._pytree.tree_leaves(held))


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _used_buffers(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    return {n.target: gm._buffers[n.target] for n in gm.graph.nodes if n.op == "get_attr"}


@dataclass
class _Region:
    """One region's compiled code, what feeds its placeholders, and the recipe that rebinds it (or why none)."""

    module: fx.GraphModule
    feeds: list[Feed]
    report: Report
    recipe: Optional[WeightRecipe]
    why_not: Optional[str]


def _compile_block(gm: fx.GraphModule, block: Block, shared: set[int], in_blocks: set[fx.Node], config: Config,
                   autotune_cache, record: bool) -> _Region:
    extracted = extract(gm, block, shared, in_blocks)
    sub = extracted.module
    if record:
        with WeightRecorder(extracted.weights) as recorder:
            report = run_pipeline(sub, config, autotune_cache=autotune_cache)
    else:
        report = run_pipeline(sub, config, autotune_cache=autotune_cache)
    hoist(gm, extracted, block.nodes[0])
    if not record:
        return _Region(sub, extracted.feeds, report, None, "not recorded")
    blocker = reuse_blocker(sub)
    recipe, why_not = (None, blocker) if blocker else recipe_for(recorder, _used_buffers(sub), lambda t: False)
    return _Region(sub, extracted.feeds, report, recipe, why_not)


def _shared_positions(group: list[Block], in_blocks: set[fx.Node]) -> set[int]:
    """Input positions at which every block of the group reads the same outer node, computed outside blocks."""
    first = group[0]
    return {p for p, node in enumerate(first.inputs)
            if node not in in_blocks and all(b.inputs[p] is node for b in group[1:])}


def _stitch(gm: fx.GraphModule, block: Block, region: _Region, module: fx.GraphModule, index: int,
            replaced: dict[fx.Node, fx.Node]) -> None:
    """Replace the block's nodes by one call of `module` (the region's code, bound to this block's weights), in
    place; `replaced` maps the outputs of blocks stitched before to the nodes that now stand for them, and gets
    this block's."""
    name = f"{REGION_PREFIX}{index}"
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(block.nodes[0]):
        args = tuple(replaced.get(n, n) for n in (feed.resolve(block) for feed in region.feeds))
        call = gm.graph.call_module(name, args)
        call.meta["val"] = tuple(n.meta.get("val") for n in block.outputs)
        call.meta["ttftc_region"] = block.name
        results = []
        for i, out in enumerate(block.outputs):
            item = gm.graph.call_function(operator.getitem, (call, i))
            item.meta["val"] = out.meta.get("val")
            results.append(item)
    for out, item in zip(block.outputs, results):
        out.replace_all_uses_with(item)
        replaced[out] = item
    for node in reversed(block.nodes):
        gm.graph.erase_node(node)
    for weight in block.weights:
        gm.graph.erase_node(weight)
        if isinstance(weight.target, str) and weight.target in gm._buffers:
            del gm._buffers[weight.target]


def compile_regions(gm: fx.GraphModule, config: Config, *, autotune_cache=None,
                    notes: Optional[list[str]] = None) -> tuple[Report, RegionStats]:
    """Compile `gm` (a frozen aten graph) region by region, in place; see the module docstring."""
    notes = list(notes or [])
    stats = RegionStats()
    blocks, why_none = find_blocks(gm, config.quant_skip)
    if not blocks:
        notes.append(f"regions: none, the graph compiled whole ({why_none})")
        return run_pipeline(gm, config, autotune_cache=autotune_cache, notes=notes), stats
    groups = group_regions(blocks)
    stats.blocks, stats.regions = len(blocks), len(groups)
    merged = Report()
    in_blocks = {n for block in blocks for n in block.nodes}
    placed: dict[str, tuple[_Region, fx.GraphModule]] = {}
    for group in groups:
        shared = _shared_positions(group, in_blocks)
        first = _compile_block(gm, group[0], shared, in_blocks, config, autotune_cache, record=len(group) > 1)
        stats.full_compiles += 1
        placed[group[0].name] = (first, first.module)
        merged.merge(first.report)
        for block in group[1:]:
            sources = [constant_value(gm, w) for w in block.weights]
            bound = _rebind(first, sources)
            if isinstance(bound, fx.GraphModule):
                placed[block.name] = (first, bound)
                stats.reused += 1
                stats.replayed_calls += len(first.recipe.calls)
                merged.merge(first.report)
            else:
                own = _compile_block(gm, block, shared, in_blocks, config, autotune_cache, record=False)
                stats.full_compiles += 1
                placed[block.name] = (own, own.module)
                merged.merge(own.report)
                if first.recipe is not None:  # the region's own reason is said once, by _describe_group
                    notes.append(f"region {group[0].name}: {block.name} compiled on its own: {bound}")
        notes.append(_describe_group(group, first))
    replaced: dict[fx.Node, fx.Node] = {}
    for index, block in enumerate(blocks):
        region, module = placed[block.name]
        _stitch(gm, block, region, module, index, replaced)
    gm.graph.lint()
    gm.recompile()
    notes.insert(0, f"regions: {stats.blocks} repeated blocks in {stats.regions} distinct region(s); "
                    f"{stats.full_compiles} compiled, {stats.reused} reused compiled code with their own weights "
                    f"({stats.replayed_calls} weight transforms replayed)")
    outer = run_pipeline(gm, config, autotune_cache=autotune_cache, notes=notes)
    outer.merge(merged)
    outer.graphs = 1
    outer.notes = list(dict.fromkeys(outer.notes))  # each block's report repeats the machine's measurements
    return outer, stats


def _rebind(region: _Region, sources: list) -> "fx.GraphModule | str":
    """The region's compiled code bound to `sources` (another block's weights), or why it cannot be."""
    if region.recipe is None:
        return region.why_not or "no recipe"
    mismatch = region.recipe.matches(sources)
    if mismatch is not None:
        return mismatch
    try:
        return bind(region.module, region.recipe.replay(sources))
    except ReplayMismatch as exc:
        return str(exc)


def _describe_group(group: list[Block], first: _Region) -> str:
    names = group[0].name if len(group) == 1 else f"{group[0].name} .. {group[-1].name} ({len(group)} blocks)"
    if len(group) == 1:
        return f"region {names}: compiled on its own (no other block has its structure)"
    if first.recipe is None:
        return f"region {names}: each block compiled on its own, reuse not proven safe: {first.why_not}"
    return f"region {names}: compiled once, the others rebound to their own weights"
