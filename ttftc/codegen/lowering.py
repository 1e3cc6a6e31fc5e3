"""Lowering: each ttftc op node gets the first capable provider for its device.

A provider registers an implementation for an op with a capability check. The check looks only at metadata
(FakeTensors from `node.meta["val"]`, scalars) and returns None when capable or a short reason when not; it never
raises. That makes fallback structural, as in Thunder's executors: an incapable provider is skipped, and the torch
reference (the op's own body) always remains.

Provider modules live in ttftc/codegen/<provider>/ and register themselves on import; `load_providers` imports
them all. A provider whose library is missing (no triton, no torch_npu) simply registers nothing or reports
itself incapable.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from ttftc.ops.registry import get_op, op_name_of

PROVIDER_PACKAGES = ("triton", "npu", "cpu")
REFERENCE = "reference"


@dataclass(frozen=True)
class LoweringContext:
    device_type: str  # "cpu" | "cuda" | "npu" | ...
    forced_provider: Optional[str]  # None under provider="auto"

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


_LOWERINGS: dict[str, list[Lowering]] = {}


def register_lowering(
    op: str,
    provider: str,
    *,
    unsupported_reason: Callable[..., Optional[str]],
    priority: int = 0,
    prepare: Optional[Callable[[fx.GraphModule, fx.Node], None]] = None,
):
    """Decorator for a provider implementation of ttftc op `op`."""
    get_op(op)  # fail at import time on a typo, not at compile time

    def wrap(impl: Callable) -> Callable:
        entry = Lowering(op, provider, impl, unsupported_reason, priority, prepare)
        entries = [e for e in _LOWERINGS.get(op, []) if e.provider != provider]
        entries.append(entry)
        entries.sort(key=lambda e: -e.priority)
        _LOWERINGS[op] = entries
        return impl

    return wrap


def lowerings_for(op: str) -> list[Lowering]:
    return list(_LOWERINGS.get(op, []))


_providers_loaded = False


def load_providers() -> None:
    """Import every provider module once, so their lowerings are registered."""
    global _providers_loaded
    if _providers_loaded:
        return
    for package_name in PROVIDER_PACKAGES:
        package = importlib.import_module(f"ttftc.codegen.{package_name}")
        for info in pkgutil.iter_modules(package.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{package.__name__}.{info.name}")
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


def choose(op: str, ctx: LoweringContext, args, kwargs) -> tuple[Optional[Lowering], list[str]]:
    skipped = []
    for entry in lowerings_for(op):
        if ctx.forced_provider is not None and entry.provider != ctx.forced_provider:
            continue
        try:
            reason = entry.unsupported_reason(ctx, *args, **kwargs)
        except Exception as exc:  # a broken check must not break the compile: treat as incapable
            reason = f"capability check raised {type(exc).__name__}: {exc}"
        if reason is None:
            return entry, skipped
        skipped.append(f"{entry.provider}: {reason}")
    return None, skipped


def _tuned_config(op: str, provider: str, node: fx.Node, cache=None) -> Optional[dict]:
    """The autotuned config for this op instance from the persistent cache (`cache`, else the default autotune
    cache), if `ttftc autotune` stored one."""
    from ttftc.autotune.cache import AutotuneCache
    from ttftc.autotune.keys import key_for
    from ttftc.autotune.space import Problem, space_for

    device_type = _node_device_type(node)
    if space_for(op, provider, device_type) is None:
        return None
    args, kwargs = _meta(node.args), _meta(node.kwargs)
    if not Problem.is_static(args, kwargs):
        return None
    cache = cache if cache is not None else AutotuneCache()
    entry = cache.lookup(key_for(Problem.from_meta(op, provider, args, kwargs), device_type))
    return entry.config if entry is not None else None


def lower_graph(gm: fx.GraphModule, *, provider: str, autotune: bool = True,
                autotune_cache=None) -> list[LoweringDecision]:
    """Swap each ttftc op node's target for its chosen provider's implementation, in place.

    The device comes from each node's own output, never from the Config: a lowering for a device the tensors
    are not on could only crash. With `autotune` (Config.autotune), each lowering gets the config `ttftc autotune`
    stored for its op instance in `autotune_cache` (an AutotuneCache; None: the default one), if any.
    """
    load_providers()
    forced = None if provider == "auto" else provider
    decisions = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        op = op_name_of(node.target)
        if op is None:
            continue
        ctx = LoweringContext(device_type=_node_device_type(node), forced_provider=forced)
        chosen = None
        skipped = []
        if forced != REFERENCE:
            chosen, skipped = choose(op, ctx, _meta(node.args), _meta(node.kwargs))
        if chosen is None:
            decisions.append(LoweringDecision(node.name, op, REFERENCE, skipped))
            continue
        node.meta["ttftc_op"] = op
        tuned = _tuned_config(op, chosen.provider, node, autotune_cache) if autotune else None
        if tuned is not None:
            node.kwargs = {**node.kwargs, "tuning_config": tuned}
        if chosen.prepare is not None:
            try:
                chosen.prepare(gm, node)
            except Exception as exc:  # keep the reference rather than fail the compile
                skipped.append(f"{chosen.provider}: prepare raised {type(exc).__name__}: {exc}")
                decisions.append(LoweringDecision(node.name, op, REFERENCE, skipped))
                continue
        node.target = chosen.impl
        node.meta["ttftc_provider"] = chosen.provider
        decisions.append(LoweringDecision(node.name, op, chosen.provider, skipped))
    gm.recompile()
    return decisions
