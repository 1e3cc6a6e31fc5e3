"""Lowering: each ttftc op node gets the first capable provider for its device.

The providers and their capability checks are registered in codegen/registry.py; importing codegen/providers.py
registers all of them. This module chooses among them, node by node, and retargets the node to the choice (a
Python function for the eager code generator, the lowering's own custom op for Inductor, codegen/lowered_ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

import ttftc.codegen.providers  # noqa: F401  (registers every provider's lowerings)
from ttftc.autotune.cache import AutotuneCache
from ttftc.autotune.keys import key_for
from ttftc.autotune.space import Problem, space_for, tuning_axes
from ttftc.codegen.lowered_ops import TUNING_ARG, encode_tuning, lowered_op
from ttftc.codegen.registry import INLINE, REFERENCE, Lowering, LoweringContext, lowerings_for
from ttftc.codegen.tuned_per_shape import TunedPerShape
from ttftc.fx_utils import inline_function, refresh_meta
from ttftc.ops.registry import op_name_of


def _meta(arg):
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_meta(a) for a in arg)
    return arg


def _node_device_type(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        val = val[0]
    if isinstance(val, torch.Tensor):
        return val.device.type
    return "cpu"


@dataclass
class LoweringDecision:
    node: str
    op: str
    provider: str
    skipped: list[str] = field(default_factory=list)  # "provider: reason" for each provider passed over


def choose(op: str, ctx: LoweringContext, args, kwargs, exclude: tuple[str, ...] = ()) -> tuple[Optional[Lowering], list[str]]:
    skipped = []
    for entry in lowerings_for(op):
        if (ctx.forced_provider is not None and entry.provider != ctx.forced_provider) or entry.provider in exclude:
            continue
        try:
            reason = entry.unsupported_reason(ctx, *args, **kwargs)
        except Exception as exc:  # a broken check must not break the compile: treat as incapable
            reason = f"capability check raised {type(exc).__name__}: {exc}"
        if reason is None:
            return entry, skipped
        skipped.append(f"{entry.provider}: {reason}")
    return None, skipped


def _tunable(op: str, provider: str, node: fx.Node) -> bool:
    return space_for(op, provider, _node_device_type(node)) is not None


def _is_static(node: fx.Node) -> bool:
    return Problem.is_static(_meta(node.args), _meta(node.kwargs))


def _tuned_config(op: str, provider: str, node: fx.Node, cache=None) -> Optional[dict]:
    """The autotuned config for this op instance from the persistent cache (`cache`, else the default autotune
    cache), if `ttftc autotune` stored one. Only for static shapes (see codegen/tuned_per_shape.py)."""
    device_type = _node_device_type(node)
    if not _tunable(op, provider, node) or not _is_static(node):
        return None
    args, kwargs = _meta(node.args), _meta(node.kwargs)
    cache = cache if cache is not None else AutotuneCache()
    entry = cache.lookup(key_for(Problem.from_meta(op, provider, args, kwargs), device_type),
                         axes=tuning_axes(op, provider))
    return entry.config if entry is not None else None


def lower_graph(gm: fx.GraphModule, *, provider: str, autotune: bool = True,
                autotune_cache=None, as_ops: bool = False) -> list[LoweringDecision]:
    """Swap each ttftc op node's target for its chosen provider's implementation, in place.

    The device comes from each node's own output, never from the Config: a lowering for a device the tensors
    are not on could only crash. With `autotune` (Config.autotune), each lowering gets the config `ttftc autotune`
    stored for its op instance in `autotune_cache` (an AutotuneCache; None: the default one), if any.

    `as_ops=False` (the eager code generator) makes the target the lowering's Python function. `as_ops=True`
    (Inductor) makes it the lowering's own custom op (codegen/lowered_ops.py), with the tuned config as an
    argument and the node's metadata recomputed from that op's fake; a lowering of the INLINE provider is instead
    inlined as the graph of its decomposition, whose own ttftc ops are then lowered in turn.
    """
    forced = None if provider == "auto" else provider
    codegen = "inductor" if as_ops else "eager"
    decisions = []
    pending = [n for n in gm.graph.nodes if n.op == "call_function" and op_name_of(n.target) is not None]
    while pending:
        node = pending.pop(0)
        op = op_name_of(node.target)
        ctx = LoweringContext(device_type=_node_device_type(node), forced_provider=forced, codegen=codegen)
        chosen = None
        skipped = []
        if forced != REFERENCE:
            chosen, skipped = choose(op, ctx, _meta(node.args), _meta(node.kwargs))
        if chosen is None:
            decisions.append(LoweringDecision(node.name, op, REFERENCE, skipped))
            continue
        if chosen.provider == INLINE:
            try:
                pending = _inline(gm, node, chosen) + pending
                decisions.append(LoweringDecision(node.name, op, chosen.provider, skipped))
                continue
            except Exception as exc:  # a decomposition that does not trace here: the op's kernel instead
                skipped.append(f"{INLINE}: inlining raised {type(exc).__name__}: {exc}")
                chosen, more = choose(op, ctx, _meta(node.args), _meta(node.kwargs), exclude=(INLINE,))
                skipped += more
                if chosen is None:
                    decisions.append(LoweringDecision(node.name, op, REFERENCE, skipped))
                    continue
        decisions.append(LoweringDecision(node.name, op, chosen.provider, skipped))
        node.meta["ttftc_op"] = op
        tuned = _tuned_config(op, chosen.provider, node, autotune_cache) if autotune else None
        if tuned is not None and not as_ops:
            node.kwargs = {**node.kwargs, "tuning_config": tuned}
        elif tuned is not None:
            node.meta["ttftc_tuning"] = tuned
        if chosen.prepare is not None:
            try:
                chosen.prepare(gm, node)
            except Exception as exc:  # keep the reference rather than fail the compile
                skipped.append(f"{chosen.provider}: prepare raised {type(exc).__name__}: {exc}")
                decisions[-1] = LoweringDecision(node.name, op, REFERENCE, skipped)
                continue
        if as_ops:
            _retarget_to_lowered_op(gm, node, chosen)
        elif autotune and not _is_static(node) and _tunable(op, chosen.provider, node):
            node.target = TunedPerShape(op, chosen.provider, ctx.device_type, chosen.impl, autotune_cache)
        else:
            node.target = chosen.impl
        node.meta["ttftc_provider"] = chosen.provider
    gm.recompile()
    return decisions


def _inline(gm: fx.GraphModule, node: fx.Node, chosen: Lowering) -> list[fx.Node]:
    """Inline `chosen`'s decomposition in place of `node`; returns the ttftc op nodes it brought in."""
    before = set(gm.graph.nodes)
    inline_function(gm, node, chosen.impl)
    return [n for n in gm.graph.nodes
            if n not in before and n.op == "call_function" and op_name_of(n.target) is not None]


def _retarget_to_lowered_op(gm: fx.GraphModule, node: fx.Node, chosen: Lowering) -> None:
    node.target = lowered_op(chosen)
    tuning = encode_tuning(node.meta.pop("ttftc_tuning", None))
    if tuning:
        node.kwargs = {**node.kwargs, TUNING_ARG: tuning}
    refresh_meta(gm, node)
