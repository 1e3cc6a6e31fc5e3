"""Each chosen lowering as a torch custom op of its own: how a code generator that can only call ops sees it.

The eager code generator swaps a ttftc op node's target for its lowering's Python function. Inductor cannot call
a Python function from generated code, but it calls any registered op as an extern kernel. So for
`codegen="inductor"` every (op, provider) lowering becomes `torch.ops.ttftc_impl.<op>_<provider>`: the semantic
op's schema plus a `tuning` string (the autotuned config as JSON, "" for the defaults), the lowering as its kernel,
and a fake implementation for Inductor's shape and layout planning.

Inductor plans the buffers around an extern kernel from the fake's strides, so a lowering's output must have
exactly the layout its fake declares. The default fake is the semantic op's (contiguous outputs) and the kernel
makes its outputs contiguous if the lowering returned a view; a lowering whose natural layout differs (the CPU
flash-attention kernel writes [B, S, H, D]) declares that layout with `register_lowering(..., fake=...)` and
returns it.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Optional

import torch

from ttftc.codegen.providers import all_lowerings
from ttftc.codegen.registry import Lowering
from ttftc.ops.registry import get_op

NAMESPACE = "ttftc_impl"
TUNING_ARG = "tuning"

_library = torch.library.Library(NAMESPACE, "FRAGMENT")  # the registry these ops live in


def lowered_op_name(lowering: Lowering) -> str:
    return f"{lowering.op}_{lowering.provider}"


def _schema(op: str, name: str) -> str:
    """The semantic op's schema under `name`, with the keyword-only `str tuning=""` appended."""
    schema = get_op(op).overload._schema
    text = str(schema)
    arguments, returns = text[text.index("(") + 1:text.rindex(") -> ")], text[text.rindex(") -> ") + 5:]
    has_keyword_only = any(a.kwarg_only for a in schema.arguments)
    tuning = f'str {TUNING_ARG}=""' if has_keyword_only else f'*, str {TUNING_ARG}=""'
    return f"{name}({arguments}, {tuning}) -> {returns}"


@functools.lru_cache(maxsize=None)
def _parse_tuning(text: str) -> Optional[dict]:
    return json.loads(text) if text else None


def encode_tuning(config: Optional[dict]) -> str:
    return json.dumps(config, sort_keys=True) if config else ""


def _contiguous_outputs(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out if out.is_contiguous() else out.contiguous()
    return type(out)(_contiguous_outputs(o) for o in out)


_DEFINED: dict[tuple[str, str], torch._ops.OpOverload] = {}


def lowered_op(lowering: Lowering) -> torch._ops.OpOverload:
    """The custom op that runs `lowering` (defined on first use, once per process)."""
    key = (lowering.op, lowering.provider)
    if key in _DEFINED:
        return _DEFINED[key]
    name = lowered_op_name(lowering)
    _library.define(_schema(lowering.op, name))
    declared_layout = lowering.fake is not None

    def kernel(*args, **kwargs):
        tuning = _parse_tuning(kwargs.pop(TUNING_ARG, ""))
        if tuning is not None:
            kwargs["tuning_config"] = tuning
        out = lowering.impl(*args, **kwargs)
        return out if declared_layout else _contiguous_outputs(out)

    def fake(*args, **kwargs):
        kwargs.pop(TUNING_ARG, None)
        return (lowering.fake or get_op(lowering.op).reference_fake)(*args, **kwargs)

    _library.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_library)
    overload = getattr(torch.ops, NAMESPACE).__getattr__(name).default
    _DEFINED[key] = overload
    return overload


def define_all() -> None:
    """Define the op of every registered lowering now. Code that Inductor loads from its cache calls these ops by
    name without running the pass that would otherwise define them on first use."""
    for entry in all_lowerings():
        lowered_op(entry)
