"""What a stored graph may call, and with which arguments: the allow-list behind graph_format.py.

A stored graph names its call targets as strings, and the file is untrusted (anyone with write access can craft it and
recompute its checksums). So a name resolves only through explicit tables, never by walking attributes or importing
what the file names:

- `{"op": "aten::NAME.OVERLOAD"}` or `{"op": "ttftc::NAME.OVERLOAD"}`: an OpOverload of those two namespaces, minus
  the aten ops that read files, print, or index memory without bounds checks (`from_file`, `_print`, `set_`, the
  `*_unsafe*` sparse constructors, `_unsafe_index*`), and only ops that return tensors;
- `{"fn": "_operator:getitem"}`: indexing a multi-tensor result;
- `{"op": "prims::convert_element_type.default"}`, the one prims op captured graphs keep;
- in a graph with symbolic sizes only (dynamic_format.py): `{"fn": "_operator:add"}` (sub, mul, floordiv, mod,
  neg, and `torch:sym_max`, `torch:sym_min`) and `{"op": "aten::sym_size.int"}` on integers and earlier symbolic
  sizes, each checked at run time to stay within int64 (a chain of products could otherwise grow a Python integer
  without bound), and
  `{"tuned": "ttftc.codegen.<provider>.<module>:<function>"}`, a lowering that looks its autotuned config up per
  call shape (codegen/tuned_per_shape.py);
- `{"fn": "ttftc.codegen.<provider>.<module>:<function>"}`: a lowering registered with ttftc's lowering registry.
  Only that provider module is imported (it registers its lowerings; loading a CPU graph never imports Triton), and
  the function is then taken from the registry.

Each call is then checked against the schema of the op (for a lowering, the ttftc op it implements, plus its
`tuning_config`): every keyword is an argument the op declares, required arguments are present, and every value has
the schema's type: a tensor argument is a node that produces a tensor (or a number, for the ops to which torch binds
numbers as tensors: add, mul, ...), an int is an int (not a bool), a dtype a dtype, and `int[N]` alone takes a single
int.
So a graph that loads also calls without a TypeError from a mistyped argument.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import operator
import pkgutil
import re
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import torch

import ttftc.ops  # noqa: F401  (registers torch.ops.ttftc.*, which stored graphs call)
from ttftc.autotune.space import knob_reason, tuning_axes
from ttftc.codegen.registry import lowerings_for
from ttftc.codegen.tuned_per_shape import TunedPerShape
from ttftc.ops.registry import all_ops, get_op

OP_NAMESPACES = ("aten", "ttftc")
_PRIMS = frozenset({"convert_element_type"})  # prims ops a captured graph keeps; no other prims op is read
GETITEM = "_operator:getitem"
TUNING_CONFIG = "tuning_config"
_PROVIDER_MODULE = re.compile(r"ttftc\.codegen\.(triton|npu|cpu)\.([a-z][a-z0-9_]*)\Z")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_REFUSED_ATEN = frozenset({"from_file", "_print", "set_", "set_data", "record_stream", "_cufft_set_plan_cache_max_size"})
_SAFE_UNSAFE_ATEN = frozenset({"_unsafe_view"})  # a view with the usual size check; capture emits it often


class GraphFormatError(ValueError):
    """A graph cannot be saved (an unsupported target or argument) or a saved graph cannot be read."""


# Records are NamedTuples: a frozen dataclass is slow to define (benchmarks/README.md, start-up), and loading an
# artifact imports this module.
class Ref:
    """A reference to an earlier node, by its name in the file (not a tuple: arguments hold real tuples)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Ref({self.name!r})"


class Tensors(NamedTuple):
    """What a multi-tensor node produces: `count` tensors (None: a list of any length)."""

    count: Optional[int]


TENSOR = "tensor"
SYMINT = "symint"  # a symbolic size: an int at run time (placeholders and sym ops of dynamic graphs only)
Produces = Union[str, Tensors]  # TENSOR, SYMINT or Tensors(...)


Check = Callable[[Any, Mapping[str, Produces]], bool]  # (value, what earlier nodes produce) -> fits


class Param(NamedTuple):
    """One schema argument, with its type compiled into a check (schemas are read once per callee, not per call)."""

    name: str
    positional: bool
    required: bool
    type_text: str
    fits: Check


class Callee(NamedTuple):
    """A resolved call target with its schema: how it is named in a file, what it takes, what it returns."""

    target: Any
    name: str
    params: Optional[tuple[Param, ...]]  # None for operator.getitem
    takes_tuning: bool
    produces: Optional[Produces]
    tuning_axes: Optional[Mapping[str, tuple]] = None  # the lowering's autotune knobs and their values, if any
    lowering: Any = None  # the registry's Lowering, for a lowering target


def _refused_aten(opname: str) -> bool:
    return opname in _REFUSED_ATEN or ("unsafe" in opname and opname not in _SAFE_UNSAFE_ATEN)


def _produces(schema: torch._C.FunctionSchema) -> Produces:
    kinds = [r.real_type.kind() for r in schema.returns]
    if kinds == ["TensorType"]:
        return TENSOR
    if kinds == ["ListType"] and schema.returns[0].real_type.getElementType().kind() == "TensorType":
        return Tensors(None)
    if len(kinds) > 1 and all(k == "TensorType" for k in kinds):
        return Tensors(len(kinds))
    raise GraphFormatError(f"op {schema.name} returns {[str(r.real_type) for r in schema.returns]}, not tensors")


@functools.lru_cache(maxsize=None)
def _resolve_op(name: str) -> Callee:
    """The OpOverload `namespace::op.overload`, for the aten and ttftc namespaces only."""
    namespace, sep, rest = name.partition("::")
    opname, dot, overload = rest.rpartition(".")
    if name == _SYM_SIZE:
        return Callee(torch.ops.aten.sym_size.int, name, None, False, SYMINT)
    allowed = namespace in OP_NAMESPACES or (namespace == "prims" and opname in _PRIMS)
    if not (sep and dot and allowed and _NAME.match(opname) and _NAME.match(overload)
            and not opname.startswith("__") and not overload.startswith("__")):
        raise GraphFormatError(f"op {name!r} is not an {' or '.join(OP_NAMESPACES)} op name like aten::neg.default")
    if namespace == "aten" and _refused_aten(opname):
        raise GraphFormatError(f"op {name} is refused: it reads files, prints, or skips bounds checks")
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), opname), overload)
    except (AttributeError, RuntimeError):
        op = None
    if (not isinstance(op, torch._ops.OpOverload) or op.namespace != namespace or op._opname != opname
            or op._overloadname != overload):
        raise GraphFormatError(f"op {name} does not exist in this torch/ttftc")
    allow_numbers = getattr(torch._C, "_should_allow_numbers_as_tensors", lambda name: False)
    return Callee(op, name, _params(op._schema, bool(allow_numbers(opname))), False, _produces(op._schema))


@functools.lru_cache(maxsize=None)
def _provider_modules(package: str) -> frozenset[str]:
    """The lowering modules of one provider package (those ttftc/codegen/providers.py imports)."""
    path = importlib.import_module(f"ttftc.codegen.{package}").__path__
    return frozenset(info.name for info in pkgutil.iter_modules(path) if not info.name.startswith("_"))


def _registered_lowerings() -> dict[str, Any]:
    return {f"{lowering.impl.__module__}:{lowering.impl.__qualname__}": lowering
            for op in all_ops() for lowering in lowerings_for(op)}


def _accepted_keywords(fn: Callable) -> frozenset[str]:
    """The keyword names `fn` accepts: every layer's named parameters (the thread-count wrapper adds one)."""
    names: set[str] = set()
    layer: Any = fn
    while layer is not None:
        names.update(p.name for p in inspect.signature(layer, follow_wrapped=False).parameters.values()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        layer = getattr(layer, "__wrapped__", None)
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def _resolve_function(name: str) -> Callee:
    """operator.getitem, or the lowering registered under `ttftc.codegen.<provider>.<module>:<function>`."""
    if name == GETITEM:
        return Callee(operator.getitem, name, None, False, None)
    module, sep, function = name.partition(":")
    matched = _PROVIDER_MODULE.match(module)
    if not (sep and matched and _NAME.match(function) and matched.group(2) in _provider_modules(matched.group(1))):
        raise GraphFormatError(f"function {name!r} is not operator.getitem or a ttftc lowering "
                               "(ttftc.codegen.<provider>.<module>:<function>)")
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise GraphFormatError(f"lowering module {module} cannot be imported here: {exc}") from None
    lowering = _registered_lowerings().get(name)
    if lowering is None:
        raise GraphFormatError(f"function {name} is not a registered ttftc lowering")
    schema = get_op(lowering.op).overload._schema
    accepted = _accepted_keywords(lowering.impl)
    missing = sorted({a.name for a in schema.arguments} - accepted)
    if missing:
        raise GraphFormatError(f"lowering {name} does not take the arguments {missing} of ttftc::{lowering.op}")
    return Callee(lowering.impl, name, _params(schema, False), TUNING_CONFIG in accepted, _produces(schema),
                  tuning_axes=tuning_axes(lowering.op, lowering.provider), lowering=lowering)


def resolve_target(data: Any, symbolic: bool = False) -> Callee:
    """The callee a node's `target` entry names: {"op": NAME} or {"fn": NAME}; with `symbolic` (a graph with
    symbolic sizes), also the sym ops and {"tuned": NAME}."""
    if isinstance(data, dict) and len(data) == 1:
        (kind, name), = data.items()
        if kind == "op" and isinstance(name, str) and (symbolic or name != _SYM_SIZE):
            return _resolve_op(name)
        if kind == "fn" and isinstance(name, str):
            if name in _SYM_FUNCTIONS and symbolic:
                return _SYM_FUNCTIONS[name]
            return _resolve_function(name)
        if kind == "tuned" and isinstance(name, str) and symbolic:
            return _resolve_tuned(name)
    raise GraphFormatError(f"a node target must be {{'op': NAME}} or {{'fn': NAME}}, got {data!r}"[:200])


def _resolve_tuned(name: str) -> Callee:
    callee = _resolve_function(name)
    if callee.lowering is None:
        raise GraphFormatError(f"tuned target {name!r} is not a ttftc lowering")
    return callee._replace(target=None, name=f"tuned {name}")  # the wrapper is made per node (tuned_target)


def tuned_target(callee: Callee, device_type: str) -> TunedPerShape:
    """A fresh per-shape tuning wrapper for a node whose target `_resolve_tuned` resolved (one per node, as
    lowering makes them: each remembers the configs of the shapes it saw)."""
    lowering = callee.lowering
    return TunedPerShape(lowering.op, lowering.provider, device_type, lowering.impl, None)


def encode_target(target: Any) -> dict:
    """The `target` entry for a live target; refuses what `resolve_target` would not resolve back to it."""
    if isinstance(target, torch._ops.OpOverload):
        name = f"{target.namespace}::{target._opname}.{target._overloadname}"
        if target.namespace not in OP_NAMESPACES and not (target.namespace == "prims" and target._opname in _PRIMS):
            raise GraphFormatError(f"graph calls {name}; only {'/'.join(OP_NAMESPACES)} ops are saved")
        if _resolve_op(name).target is not target:
            raise GraphFormatError(f"graph target {name} does not resolve back to itself")
        return {"op": name}
    if isinstance(target, TunedPerShape):
        name = f"{getattr(target.impl, '__module__', None)}:{getattr(target.impl, '__qualname__', None)}"
        if _resolve_tuned(name).lowering.impl is not target.impl:
            raise GraphFormatError(f"tuned target {name} does not resolve back to itself")
        return {"tuned": name}
    for name, callee in _SYM_FUNCTIONS.items():
        if callee.name == name and getattr(callee.target, "checks", None) is target:
            return {"fn": name}
    name = GETITEM if target is operator.getitem else (
        f"{getattr(target, '__module__', None)}:{getattr(target, '__qualname__', None)}")
    try:
        resolved = _resolve_function(name).target
    except GraphFormatError:
        resolved = None
    if resolved is not target:
        raise GraphFormatError(f"graph calls {target!r}, which is not an aten/ttftc op, operator.getitem or a "
                               "registered ttftc lowering: not saved")
    return {"fn": name}


# -- argument types -------------------------------------------------------------------------------------------
_SCALAR_TYPES: dict[str, Callable[[Any], bool]] = {
    "IntType": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "SymIntType": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "FloatType": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "BoolType": lambda v: isinstance(v, bool),
    "NumberType": lambda v: isinstance(v, (int, float)),
    "StringType": lambda v: isinstance(v, str),
    "ScalarTypeType": lambda v: isinstance(v, torch.dtype),
    "LayoutType": lambda v: isinstance(v, torch.layout),
    "MemoryFormatType": lambda v: isinstance(v, torch.memory_format),
    "DeviceObjType": lambda v: isinstance(v, torch.device),
}


def _check_for(jit_type: Any, fixed_length: Optional[int], wraps_numbers: bool) -> Check:
    """What torch accepts for an argument of `jit_type`, as a check of (value, what earlier nodes produce).

    `fixed_length`: N of an `int[N]` argument. `wraps_numbers`: torch binds a Python number to this callee's
    (non-optional) Tensor arguments.
    """
    kind = jit_type.kind()
    if kind == "OptionalType":
        inner = _check_for(jit_type.getElementType(), fixed_length, False)
        return lambda value, produced: value is None or inner(value, produced)
    if kind == "TensorType":
        if wraps_numbers:  # x * 1.0: torch wraps the number (a symbolic size too)
            return lambda value, produced: (produced[value.name] in (TENSOR, SYMINT) if isinstance(value, Ref)
                                            else isinstance(value, (int, float)))
        return lambda value, produced: isinstance(value, Ref) and produced[value.name] == TENSOR
    if kind == "ListType":
        element_kind = jit_type.getElementType().kind()
        element = _check_for(jit_type.getElementType(), None, False)
        takes_result = element_kind in ("TensorType", "OptionalType")  # a whole multi-tensor result as a list
        takes_one_int = fixed_length is not None and element_kind in ("IntType", "SymIntType")  # int[N] takes 3

        def fits_list(value: Any, produced: Mapping[str, Produces]) -> bool:
            if isinstance(value, Ref):
                return takes_result and isinstance(produced[value.name], Tensors)
            if takes_one_int and isinstance(value, int):
                return element(value, produced)
            return isinstance(value, (list, tuple)) and all(element(v, produced) for v in value)

        return fits_list
    scalar = _SCALAR_TYPES.get(kind)
    if scalar is None:  # a Generator, a Dict, ...: nothing a stored graph passes
        return lambda value, produced: False
    if kind in ("SymIntType", "NumberType"):  # where a traced graph passes a symbolic size
        return lambda value, produced: (produced[value.name] == SYMINT if isinstance(value, Ref) else scalar(value))
    return lambda value, produced: not isinstance(value, Ref) and scalar(value)


def _params(schema: torch._C.FunctionSchema, wraps_numbers: bool) -> tuple[Param, ...]:
    return tuple(Param(a.name, not a.kwarg_only, not a.has_default_value(), str(a.real_type),
                       _check_for(a.real_type, a.N, wraps_numbers)) for a in schema.arguments)


def _check_tuning(value: Any, axes: Optional[Mapping[str, tuple]], where: str) -> None:
    """A tuned config is a point of the lowering's search space (autotune.space.knob_reason)."""
    if value is None:
        return
    if not isinstance(value, dict) or not all(v is None or isinstance(v, (bool, int, float, str)) for v in value.values()):
        raise GraphFormatError(f"{where}: {TUNING_CONFIG} must be a dict of scalars, got {value!r}"[:200])
    reason = knob_reason(value, axes)
    if reason is not None:
        raise GraphFormatError(f"{where}: {TUNING_CONFIG}: {reason}"[:300])


def check_call(callee: Callee, args: tuple, kwargs: dict, produced: Mapping[str, Produces], where: str) -> Produces:
    """Check one call's arguments against the callee's schema; returns what the call produces."""
    if callee.produces == SYMINT:
        return _check_sym_call(callee, args, kwargs, produced, where)
    if callee.params is None:
        return _check_getitem(args, kwargs, produced, where)
    if callee.takes_tuning and TUNING_CONFIG in kwargs:
        kwargs = dict(kwargs)
        _check_tuning(kwargs.pop(TUNING_CONFIG), callee.tuning_axes, where)
    positional = [p for p in callee.params if p.positional]
    if len(args) > len(positional):
        raise GraphFormatError(f"{where}: {len(args)} positional arguments, {callee.name} takes {len(positional)}")
    given = dict(zip((p.name for p in positional), args))
    for name, value in kwargs.items():
        if name in given or not any(p.name == name for p in callee.params):
            raise GraphFormatError(f"{where}: {name!r} is not an argument of {callee.name} (or is given twice)")
        given[name] = value
    for param in callee.params:
        if param.name not in given:
            if param.required:
                raise GraphFormatError(f"{where}: {callee.name} needs its argument {param.name!r}")
        elif not param.fits(given[param.name], produced):
            raise GraphFormatError(f"{where}: argument {param.name!r} of {callee.name} must be {param.type_text}, "
                                   f"got {given[param.name]!r}"[:300])
    return callee.produces


def _check_getitem(args: tuple, kwargs: dict, produced: Mapping[str, Produces], where: str) -> Produces:
    if kwargs or len(args) != 2 or not isinstance(args[0], Ref) or not isinstance(produced[args[0].name], Tensors):
        raise GraphFormatError(f"{where}: getitem takes (a multi-tensor node, an index), got {args!r}"[:200])
    count, index = produced[args[0].name].count, args[1]
    if not isinstance(index, int) or isinstance(index, bool) or (count is not None and not -count <= index < count):
        raise GraphFormatError(f"{where}: index {index!r} is out of range for {count} tensors"[:200])
    return TENSOR


# -- symbolic sizes ------------------------------------------------------------------------------------------------
_SYM_SIZE = "aten::sym_size.int"
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _is_size(value: Any, produced: Mapping[str, Produces]) -> bool:
    """An int, or a node that produces a symbolic size."""
    if isinstance(value, Ref):
        return produced[value.name] == SYMINT
    return isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]


def _int64_checked(fn: Callable, name: str) -> Callable:
    """`fn` on ints, raising OverflowError when its result leaves int64 (no tensor size or index does)."""

    def checked(*args):
        result = fn(*args)
        if not _INT64[0] <= result <= _INT64[1]:
            raise OverflowError(f"{name} of {args} leaves int64")
        return result

    checked.__name__ = checked.__qualname__ = f"checked_{name}"
    checked.checks = fn  # type: ignore[attr-defined]  (what it wraps: how encode_target recognises the op)
    return checked


# name in a file -> (the function a captured graph calls, how many ints it takes)
_SYM_OPS = {**{f"_operator:{name}": (getattr(operator, name), 2) for name in ("add", "sub", "mul", "floordiv", "mod")},
            "_operator:neg": (operator.neg, 1),
            "torch:sym_max": (torch.sym_max, 2), "torch:sym_min": (torch.sym_min, 2)}
_SYM_ARITY = {name: arity for name, (_, arity) in _SYM_OPS.items()}
_SYM_FUNCTIONS = {name: Callee(_int64_checked(fn, name.partition(":")[2]), name, None, False, SYMINT)
                  for name, (fn, _) in _SYM_OPS.items()}


def _check_sym_call(callee: Callee, args: tuple, kwargs: dict, produced: Mapping[str, Produces],
                    where: str) -> Produces:
    if callee.name == _SYM_SIZE:
        if (kwargs or len(args) != 2 or not (isinstance(args[0], Ref) and produced[args[0].name] == TENSOR)
                or not isinstance(args[1], int) or isinstance(args[1], bool) or not -64 <= args[1] < 64):
            raise GraphFormatError(f"{where}: sym_size takes (a tensor node, a dimension), got {args!r}"[:200])
        return SYMINT
    arity = _SYM_ARITY[callee.name]
    if kwargs or len(args) != arity or not all(_is_size(a, produced) for a in args):
        raise GraphFormatError(f"{where}: {callee.name} takes {arity} int64 integers or symbolic sizes, got "
                               f"{args!r}"[:200])
    return SYMINT
