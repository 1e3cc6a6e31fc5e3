"""How a semantic op is declared: a torch custom op whose body is the plain-torch reference.

The reference is the oracle in tests and the fallback at run time, so a graph that contains ttftc ops always
runs, lowered or not. The fake (meta) implementation lets passes compute `node.meta["val"]` and lets Dynamo and
AOTAutograd trace through the op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

NAMESPACE = "ttftc"


@dataclass(frozen=True)
class OpDef:
    name: str
    overload: torch._ops.OpOverload
    reference: Callable
    flops: Callable[..., int]
    reference_fake: Callable  # the meta implementation: output shapes, dtypes and (contiguous) layout


_OPS: dict[str, OpDef] = {}


def define_op(name: str, *, fake: Callable, flops: Callable[..., int]):
    """Decorator: register `fn` (the reference) as torch.ops.ttftc.<name> with the given fake implementation."""

    def wrap(fn: Callable) -> OpDef:
        custom = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)
        custom.register_fake(fake)
        opdef = OpDef(name=name, overload=custom._opoverload, reference=fn, flops=flops, reference_fake=fake)
        _OPS[name] = opdef
        return opdef

    return wrap


def get_op(name: str) -> OpDef:
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"Unknown ttftc op {name!r}; known ops: {sorted(_OPS)}") from None


def all_ops() -> dict[str, OpDef]:
    return dict(_OPS)


def op_name_of(target) -> str | None:
    """The ttftc op name of an FX node target, or None if it is not a ttftc op."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == NAMESPACE:
        return target._opname
    return None
