"""Lowering: each ttftc op node gets the first capable provider for its device.

A provider registers an implementation for an op with a capability check. The check looks only at metadata
(FakeTensors from `node.meta["val"]`, scalars) and returns None when capable or a short reason when not; it never
raises. That makes fallback structural, as in Thunder's executors: an incapable provider is skipped, and the torch
reference (the op's own body) always remains.

Provider modules live in ttftc/codegen/<provider>/ and register themselves on import; `load_providers` imports
the ones PROVIDER_MODULES lists, and nothing else (kernel tooling such as codegen/triton/tools/ stays out of a
compile). A provider whose library is missing (no triton, no torch_npu) simply registers nothing or reports
itself incapable.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from ttftc.codegen.tuned_per_shape import TunedPerShape
from ttftc.ops.registry import get_op, op_name_of
from ttftc.fx_utils import inline_function, refresh_meta

PROVIDER_PACKAGES = ("inductor", "triton", "npu", "cpu")
# Every module that registers a lowering or a lowering's search space, grouped by provider in PROVIDER_PACKAGES
# order: among lowerings of one op with equal priority the one registered first is chosen (triton's rope and
# attention before npu's), so this order is part of the choice. A new provider module is listed here.
PROVIDER_MODULES = (
    "ttftc.codegen.inductor.ffn", "ttftc.codegen.inductor.int8_linear", "ttftc.codegen.inductor.norm",
    "ttftc.codegen.inductor.rope",
    "ttftc.codegen.triton.attention", "ttftc.codegen.triton.attention_ascend", "ttftc.codegen.triton.ffn",
    "ttftc.codegen.triton.int8_linear", "ttftc.codegen.triton.norm", "ttftc.codegen.triton.norm_linear",
    "ttftc.codegen.triton.rope",
    "ttftc.codegen.npu.attention", "ttftc.codegen.npu.ffn", "ttftc.codegen.npu.int8_linear", "ttftc.codegen.npu.norm",
    "ttftc.codegen.npu.norm_linear", "ttftc.codegen.npu.rope",
    "ttftc.codegen.cpu.attention", "ttftc.codegen.cpu.ffn", "ttftc.codegen.cpu.int8_linear", "ttftc.codegen.cpu.linear",
    "ttftc.codegen.cpu.norm", "ttftc.codegen.cpu.norm_linear", "ttftc.codegen.cpu.rope",
)
REFERENCE = "reference"
# The provider whose lowerings are decompositions, inlined into the graph for Inductor (codegen/inductor/).
INLINE = "inductor"


@dataclass(frozen=True)
class LoweringContext:
    device_type: str  # "cpu" | "cuda" | "npu" | ...
    forced_provider: Optional[str]  # None under provider="auto"
    codegen: str = "eager"  # the code generator the graph goes to: "eager" | "inductor"

    @property
    def triton_interpret(self) -> bool:
        return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Lowering:
    op: str
    provider: str
    impl: Callable[..., Any]
    # (ctx, *args, **kwargs) with FakeTensors for tensors -> None if capable, else the reason it is not.
    unsupported_reason: Callable[..., Optional[str]]
    priority: int = 0
    # Optional compile-time step: may rewrite the node's arguments (e.g. pre-pack a constant weight).
    prepare: Optional[Callable[[fx.GraphModule, fx.Node], None]] = None
    # The meta implementation of this lowering's outputs when their layout is not the op's (contiguous) one;
    # code generators that plan buffers from metadata (Inductor) need the layout the kernel really returns.
    fake: Optional[Callable[..., Any]] = None


_LOWERINGS: dict[str, list[Lowering]] = {}


def register_lowering(
    op: str,
    provider: str,
    *,
    unsupported_reason: Callable[..., Optional[str]],
    priority: int = 0,
    prepare: Optional[Callable[[fx.GraphModule, fx.Node], None]] = None,
    fake: Optional[Callable[..., Any]] = None,
):
    """Decorator for a provider implementation of ttftc op `op`."""
    get_op(op)  # fail at import time on a typo, not at compile time

    def wrap(impl: Callable) -> Callable:
        entry = Lowering(op, provider, impl, unsupported_reason, priority, prepare, fake)
        entries = [e for e in _LOWERINGS.get(op, []) if e.provider != provider]
        entries.append(entry)
        entries.sort(key=lambda e: -e.priority)
        _LOWERINGS[op] = entries
        return impl

    return wrap


def lowerings_for(op: str) -> list[Lowering]:
    return list(_LOWERINGS.get(op, []))


def all_lowerings() -> list[Lowering]:
    """Every registered lowering of every op (providers loaded first)."""
    load_providers()
    return [entry for entries in _LOWERINGS.values() for entry in entries]


_providers_loaded = False


def load_providers() -> None:
    """Import every provider module once, so their lowerings are registered.

    By name, on the first compile: the provider modules import this one (register_lowering), and a serving
    process that loads an artifact never pays for the providers it does not run."""
    global _providers_loaded
    if _providers_loaded:
        return
    for module in PROVIDER_MODULES:
        importlib.import_module(module)
    _providers_loaded = True


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
    from ttftc.autotune.space import space_for

    return space_for(op, provider, _node_device_type(node)) is not None


def _is_static(node: fx.Node) -> bool:
    from ttftc.autotune.space import Problem

    return Problem.is_static(_meta(node.args), _meta(node.kwargs))


def _tuned_config(op: str, provider: str, node: fx.Node, cache=None) -> Optional[dict]:
    """The autotuned config for this op instance from the persistent cache (`cache`, else the default autotune
    cache), if `ttftc autotune` stored one. Only for static shapes (see codegen/tuned_per_shape.py)."""
    from ttftc.autotune.cache import AutotuneCache
    from ttftc.autotune.keys import key_for
    from ttftc.autotune.space import Problem, tuning_axes

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
    load_providers()
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
    from ttftc.codegen.lowered_ops import TUNING_ARG, encode_tuning, lowered_op  # it imports this module

    node.target = lowered_op(chosen)
    tuning = encode_tuning(node.meta.pop("ttftc_tuning", None))
    if tuning:
        node.kwargs = {**node.kwargs, TUNING_ARG: tuning}
    refresh_meta(gm, node)
