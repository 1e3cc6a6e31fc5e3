"""The lowerings registry: which provider implements which ttftc op, and when it is capable.

A provider registers an implementation for an op with a capability check. The check looks only at metadata
(FakeTensors from `node.meta["val"]`, scalars) and returns None when capable or a short reason when not; it never
raises. That makes fallback structural, as in Thunder's executors: an incapable provider is skipped, and the torch
reference (the op's own body) always remains.

Provider modules (ttftc/codegen/<provider>/) import this module to register; the list of them is
ttftc/codegen/providers.py, and the choice among them codegen/lowering.py. This module imports neither, so a
provider module, or a loader that resolves one stored lowering by name (ttftc/cache/graph_calls.py), needs only it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.fx as fx

from ttftc.ops.registry import get_op

REFERENCE = "reference"
# Among lowerings of one op with equal priority, the provider earlier here is chosen (triton's rope and attention
# before npu's); a provider not listed (a test's) comes after these, in registration order.
PROVIDER_PACKAGES = ("inductor", "triton", "npu", "cpu")
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
        entries.sort(key=lambda e: (-e.priority, _provider_rank(e.provider)))
        _LOWERINGS[op] = entries
        return impl

    return wrap


def _provider_rank(provider: str) -> int:
    return PROVIDER_PACKAGES.index(provider) if provider in PROVIDER_PACKAGES else len(PROVIDER_PACKAGES)


def lowerings_for(op: str) -> list[Lowering]:
    """The lowerings of `op` registered so far (import ttftc.codegen.providers for all of them)."""
    return list(_LOWERINGS.get(op, []))


def registered_lowerings() -> list[Lowering]:
    """Every lowering registered so far, of every op."""
    return [entry for entries in _LOWERINGS.values() for entry in entries]
