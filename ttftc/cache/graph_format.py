"""A compiled prefill graph as data: nodes as JSON, constants as tensors referenced by key.

What is saved is the graph after ttftc's passes and lowering, so loading it runs neither: the graph is rebuilt node
by node and called directly. A stored graph is untrusted input (a file anyone with write access can craft, with its
checksums recomputed), so reading it is allow-list only:

- call targets resolve through explicit tables and every call is checked against its op's schema (graph_calls.py);
- every name that FX pastes into the Python source of the rebuilt graph (node names, constant and `get_attr` names,
  keyword-argument names) must be an ASCII identifier that is not a keyword, starts without `__` and is not `self`
  or `torch` (FX's code generator would let those shadow its own names);
- argument values are JSON scalars, lists, and a fixed set of tagged encodings (node reference, tuple, dict,
  non-finite float, dtype, device, layout, memory format), each checked for its type;
- every tensor lives on the graph's device type (the device an artifact was built for, the one a compile-cache
  entry is loaded on): a device argument of another type (`aten._to_copy(device="meta")`, whose result has no
  data, so a native kernel would read it through a null pointer) and a constant elsewhere are refused;
- constants must be dense tensors of the declared shape and dtype;
- given the vocabulary size token ids are checked against, the token embedding has a row for each (graph_vocab.py).

`parse_program` checks everything and fetches the constants; a problem is a GraphFormatError at that point, before
any graph runs. `ProgramSpec.build` then makes the FX graph (cheap; artifacts do it on first use). The encoder runs
the same check on what it writes, so a graph that saves also loads.
"""

from __future__ import annotations

import keyword
import math
import re
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
import torch.fx as fx

from ttftc.buckets.program import INPUT_NAMES, GraphProgram, GraphSignature, output_names
from ttftc.cache.graph_calls import TENSOR, GraphFormatError, Produces, Ref, check_call, encode_target, resolve_target
from ttftc.cache.graph_vocab import check_embedding_rows
from ttftc.cache.schema import SchemaError, as_dict, as_int, as_list, as_str, field

__all__ = ["FORMAT_VERSION", "MAX_GRAPH_BYTES", "GraphFormatError", "ProgramSpec", "decode_program", "encode_program", "graph_constants",
           "parse_program"]
FORMAT_VERSION = 1
# The largest graph file (a compile-cache entry or an artifact's graph) ttftc reads, checked before reading: one
# JSON node per op, and the constants are elsewhere, so even a large model's graph is a few MB; a file far larger is
# not a graph written here, and reading it would cost its size in memory before the parser refused it.
MAX_GRAPH_BYTES = 16 << 20
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Names FX's code generator does not rename away from: a node called `torch` shadows the module in the generated code.
_RESERVED_NAMES = frozenset({"self", "torch"})
# A constant becomes a buffer of an nn.Module, so it cannot take the name of one of the module's own attributes.
_MODULE_ATTRIBUTES = frozenset(dir(torch.nn.Module()))
_MAX_ARG_DEPTH = 16
_NODE_FIELDS = {
    "placeholder": {"name", "op"},
    "get_attr": {"name", "op", "target"},
    "call_function": {"name", "op", "target", "args", "kwargs"},
    "output": {"name", "op", "args", "kwargs"},
}
_PROGRAM_FIELDS = {"format", "signature", "inputs", "outputs", "nodes", "constants"}


def _tagged(cls: type) -> dict[str, Any]:
    return {name.removeprefix("torch."): value for name, value in vars(torch).items() if isinstance(value, cls)}


_DTYPES = _tagged(torch.dtype)
_LAYOUTS = _tagged(torch.layout)
_MEMORY_FORMATS = _tagged(torch.memory_format)
_TAGGED_VALUES = {"dtype": _DTYPES, "layout": _LAYOUTS, "memory_format": _MEMORY_FORMATS}


def _identifier(value: Any, what: str) -> str:
    if (not isinstance(value, str) or not _IDENTIFIER.match(value) or keyword.iskeyword(value)
            or value.startswith("__") or value in _RESERVED_NAMES):
        raise GraphFormatError(f"{what} {value!r} is not a plain Python identifier (ASCII, not a keyword, no "
                               f"leading '__', not {'/'.join(sorted(_RESERVED_NAMES))})")
    return value


# -- arguments ----------------------------------------------------------------------------------------------
def _encode_arg(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return {"node": arg.name}
    if arg is None or isinstance(arg, (bool, str)):
        return arg
    if isinstance(arg, int):
        return arg
    if isinstance(arg, float):
        return arg if math.isfinite(arg) else {"float": repr(arg)}
    if isinstance(arg, tuple):
        return {"tuple": [_encode_arg(a) for a in arg]}
    if isinstance(arg, (list, torch.Size)):
        return [_encode_arg(a) for a in arg]
    if isinstance(arg, dict):
        return {"dict": {str(k): _encode_arg(v) for k, v in arg.items()}}
    if isinstance(arg, torch.dtype):
        return {"dtype": str(arg).removeprefix("torch.")}
    if isinstance(arg, torch.device):
        return {"device": str(arg)}
    if isinstance(arg, torch.layout):
        return {"layout": str(arg).removeprefix("torch.")}
    if isinstance(arg, torch.memory_format):
        return {"memory_format": str(arg).removeprefix("torch.")}
    raise GraphFormatError(f"argument {arg!r} of type {type(arg).__name__} cannot be saved")


_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


_SCALARS = (type(None), bool, int, float, str)


def _decode_arg(arg: Any, defined: Mapping[str, Any], device_type: str = "cpu", depth: int = 0) -> Any:
    """`arg` with its encodings undone and node references as Ref; `defined` holds the names of earlier nodes, and
    a device must be of `device_type`.

    `arg` comes from json.loads, so exact type checks are enough (and this runs for every argument of every node).
    """
    kind_of_arg = type(arg)
    if kind_of_arg in _SCALARS:
        return arg
    if depth >= _MAX_ARG_DEPTH:
        raise GraphFormatError(f"arguments nest deeper than {_MAX_ARG_DEPTH} levels")
    if kind_of_arg is list:
        return [_decode_arg(a, defined, device_type, depth + 1) for a in arg]
    if kind_of_arg is not dict or len(arg) != 1:
        raise GraphFormatError(f"argument {arg!r} is not a JSON scalar, a list or a one-key encoding"[:200])
    (kind, value), = arg.items()
    if kind == "node":
        if type(value) is not str or value not in defined:
            raise GraphFormatError(f"argument refers to node {value!r}, which is not defined before it"[:200])
        return Ref(value)
    if kind == "tuple" and type(value) is list:
        return tuple([_decode_arg(a, defined, device_type, depth + 1) for a in value])
    if kind == "dict" and type(value) is dict:
        return {_dict_key(k): _decode_arg(v, defined, device_type, depth + 1) for k, v in value.items()}
    if type(value) is str:
        if kind == "float" and value in _NON_FINITE:
            return _NON_FINITE[value]
        if kind in _TAGGED_VALUES and value in _TAGGED_VALUES[kind]:
            return _TAGGED_VALUES[kind][value]
        if kind == "device":
            return _device(value, device_type)
    raise GraphFormatError(f"unknown argument encoding {arg!r}"[:200])


def _device(name: str, device_type: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise GraphFormatError(f"unknown device {name!r}"[:200]) from None
    if device.type != device_type:
        raise GraphFormatError(f"device {name!r}: this graph's tensors live on {device_type} (a tensor elsewhere, "
                               "a meta tensor above all, has no data a kernel here could read)"[:200])
    return device


def _dict_key(key: str) -> str:
    if not isinstance(key, str) or len(key) > 256:
        raise GraphFormatError(f"dict argument key {key!r} is not a short string"[:200])
    return key


def _bind(arg: Any, env: Mapping[str, fx.Node]) -> Any:
    """A decoded argument with each Ref replaced by its FX node."""
    if isinstance(arg, Ref):
        return env[arg.name]
    if isinstance(arg, tuple):
        return tuple(_bind(a, env) for a in arg)
    if isinstance(arg, list):
        return [_bind(a, env) for a in arg]
    if isinstance(arg, dict):
        return {k: _bind(v, env) for k, v in arg.items()}
    return arg


# -- whole graphs -------------------------------------------------------------------------------------------
def graph_constants(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The tensors behind the graph's get_attr nodes, by attribute name."""
    constants = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value: Any = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        if not isinstance(value, torch.Tensor):
            raise GraphFormatError(f"constant {node.target} is a {type(value).__name__}; only tensors can be saved")
        constants[node.target] = value
    return constants


def encode_program(program: GraphProgram, constant_key: Callable[[torch.Tensor], str],
                   device_type: str = "cpu") -> dict:
    """The program as a JSON-able dict; `constant_key` names each constant tensor (e.g. by content), and its tensors
    live on `device_type`.

    What is written is then checked exactly as a reader checks it (`parse_program`), so a graph that saves also
    loads: a target off the allow-list, a name that is not an identifier or a mistyped argument is a
    GraphFormatError here, at compile time.
    """
    nodes = []
    for node in program.gm.graph.nodes:
        entry: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            entry["target"] = encode_target(node.target)
        elif node.op == "get_attr":
            entry["target"] = node.target
        elif node.op not in ("placeholder", "output"):
            raise GraphFormatError(f"{node.op} node {node.name} cannot be saved (graphs are flat aten graphs)")
        if node.op in ("call_function", "output"):
            entry["args"] = _encode_arg(tuple(node.args))
            entry["kwargs"] = _encode_arg(dict(node.kwargs))
        nodes.append(entry)
    constants, by_key = {}, {}
    for name, tensor in graph_constants(program.gm).items():
        if not _dense(tensor.shape, tensor.stride()):
            raise GraphFormatError(f"constant {name} has overlapping strides {tensor.stride()}; cannot be saved")
        key = constant_key(tensor)
        by_key[key] = tensor
        constants[name] = {
            "key": key, "shape": list(tensor.shape), "stride": list(tensor.stride()),
            "dtype": str(tensor.dtype).removeprefix("torch."),
        }
    encoded = {
        "format": FORMAT_VERSION,
        "signature": program.signature.to_dict(),
        "inputs": list(program.inputs),
        "outputs": list(program.outputs),
        "nodes": nodes,
        "constants": constants,
    }
    try:
        parse_program(encoded, by_key.__getitem__, device_type)
    except GraphFormatError as exc:
        raise GraphFormatError(f"the graph cannot be saved: {exc}") from None
    return encoded


def _dense(shape, stride) -> bool:
    """Every element has its own memory and there are no holes: a permutation of a contiguous layout, so the
    tensor can be rebuilt from its contiguous data plus its strides (and the strides ask for no more memory)."""
    expected = 1
    for size, step in sorted(((n, s) for n, s in zip(shape, stride) if n != 1), key=lambda d: d[1]):
        if step != expected:
            return False
        expected *= size
    return True


def _restride(t: torch.Tensor, shape: tuple, stride: tuple) -> torch.Tensor:
    if tuple(t.stride()) == tuple(stride):
        return t
    out = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


class _NodeSpec(NamedTuple):
    kind: str
    name: str
    target: Any = None
    args: tuple = ()
    kwargs: Optional[dict] = None


class _ConstantSpec(NamedTuple):
    tensor: torch.Tensor
    stride: tuple[int, ...]


class ProgramSpec(NamedTuple):
    """A stored graph after every check: targets resolved, names and arguments validated, constants fetched."""

    signature: GraphSignature
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[_NodeSpec, ...]
    constants: Mapping[str, _ConstantSpec]

    def build(self) -> GraphProgram:
        gm = build_graph_module(self.constants, self.nodes, lambda args: args[0])
        return GraphProgram(self.signature, gm, self.inputs, self.outputs)


def build_graph_module(constants: dict, nodes, output_value: Callable[[Any], Any]) -> fx.GraphModule:
    """The GraphModule of checked node specs: constants as buffers in their stored strides, each node built from
    its allow-listed target; `output_value` picks what the output node returns from its stored args."""
    root = torch.nn.Module()
    for name, constant in constants.items():
        root.register_buffer(name, _restride(constant.tensor, tuple(constant.tensor.shape), constant.stride),
                             persistent=False)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for spec in nodes:
        if spec.kind == "placeholder":
            node = graph.placeholder(spec.name)
        elif spec.kind == "get_attr":
            node = graph.get_attr(spec.target)
        elif spec.kind == "call_function":
            node = graph.call_function(spec.target, _bind(spec.args, env), _bind(spec.kwargs, env))
        else:
            node = graph.output(_bind(output_value(spec.args), env))
        env[spec.name] = node
    return fx.GraphModule(root, graph)


def _parse_constants(data: Any, load_constant: Callable[[str], torch.Tensor],
                     device_type: str) -> dict[str, _ConstantSpec]:
    constants = {}
    for name, meta in as_dict(data, "constants").items():
        where = f"constants.{_identifier(name, 'constant')}"
        if name in _MODULE_ATTRIBUTES:
            raise GraphFormatError(f"constant name {name!r} is an attribute every torch.nn.Module has")
        key = as_str(field(meta, "key", where), f"{where}.key")
        shape = as_list(field(meta, "shape", where), f"{where}.shape", lambda v, w: as_int(v, w, minimum=0))
        stride = as_list(field(meta, "stride", where), f"{where}.stride", lambda v, w: as_int(v, w, minimum=0))
        dtype = as_str(field(meta, "dtype", where), f"{where}.dtype", choices=tuple(_DTYPES))
        if len(stride) != len(shape) or not _dense(shape, stride):
            raise GraphFormatError(f"constant {name}: strides {stride} do not lay out a dense tensor of shape {shape}")
        try:
            tensor = load_constant(key)
        except (KeyError, FileNotFoundError):
            raise GraphFormatError(f"constant {name}: its tensor {key!r} is missing") from None
        if not isinstance(tensor, torch.Tensor) or list(tensor.shape) != shape or tensor.dtype != _DTYPES[dtype]:
            raise GraphFormatError(f"constant {name}: stored tensor is {tuple(getattr(tensor, 'shape', ()))} "
                                   f"{getattr(tensor, 'dtype', type(tensor).__name__)}, the graph wants "
                                   f"{tuple(shape)} {dtype}")
        if tensor.device.type != device_type:
            raise GraphFormatError(f"constant {name}: stored tensor is on {tensor.device}, the graph runs on "
                                   f"{device_type}")
        constants[name] = _ConstantSpec(tensor, tuple(stride))
    return constants


def _parse_call(entry: dict, produced: dict[str, Produces], device_type: str) -> _NodeSpec:
    name = entry["name"]
    callee = resolve_target(entry["target"])
    args = _decode_arg(entry["args"], produced, device_type)
    kwargs = _decode_arg(entry["kwargs"], produced, device_type)
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise GraphFormatError(f"node {name}: args must be a tuple encoding and kwargs a dict encoding")
    for keyword_name in kwargs:
        _identifier(keyword_name, f"node {name}: keyword argument")
    produced[name] = check_call(callee, args, kwargs, produced, f"node {name}")
    return _NodeSpec("call_function", name, callee.target, args, kwargs)


def node_kind_and_name(i: int, entry: dict, nodes: list, produced: Mapping[str, Any],
                       fields: Mapping[str, set] = _NODE_FIELDS) -> tuple[str, str]:
    """The op and name of stored node `i`, checked: a known op with exactly its `fields`, nothing after the output
    node, a fresh identifier."""
    kind = entry.get("op")
    if kind not in fields or set(entry) != fields[kind]:
        raise GraphFormatError(f"nodes[{i}] must be a placeholder, get_attr, call_function or output node with "
                               f"exactly its fields, got op {kind!r} with fields {sorted(entry)}"[:300])
    if nodes and nodes[-1].kind == "output":
        raise GraphFormatError(f"nodes[{i}] follows the output node")
    name = _identifier(entry["name"], f"nodes[{i}] name")
    if name in produced:
        raise GraphFormatError(f"node name {name} is used twice")
    return kind, name


def _parse_nodes(data: Any, constants: Mapping[str, _ConstantSpec], inputs: tuple[str, ...],
                 outputs: tuple[str, ...], device_type: str) -> tuple[_NodeSpec, ...]:
    nodes: list[_NodeSpec] = []
    produced: dict[str, Produces] = {}  # what each node defined so far produces
    for i, entry in enumerate(as_list(data, "nodes", lambda v, w: as_dict(v, w))):
        kind, name = node_kind_and_name(i, entry, nodes, produced)
        if kind == "placeholder":
            nodes.append(_NodeSpec(kind, name))
        elif kind == "get_attr":
            target = _identifier(entry["target"], f"node {name}: constant")
            if target not in constants:
                raise GraphFormatError(f"node {name} reads constant {target}, which the graph does not declare")
            nodes.append(_NodeSpec(kind, name, target))
        elif kind == "call_function":
            nodes.append(_parse_call(entry, produced, device_type))
            continue
        else:
            result = _decode_arg(entry["args"], produced, device_type)
            if (entry["kwargs"] != {"dict": {}} or not isinstance(result, tuple) or len(result) != 1
                    or not isinstance(result[0], (tuple, list)) or len(result[0]) != len(outputs)
                    or not all(isinstance(r, Ref) and produced[r.name] == TENSOR for r in result[0])):
                raise GraphFormatError(f"the output node must return one tensor node per declared output "
                                       f"({len(outputs)})")
            nodes.append(_NodeSpec(kind, name, None, result))
        produced[name] = TENSOR
    placeholders = sum(1 for n in nodes if n.kind == "placeholder")
    if not nodes or nodes[-1].kind != "output" or placeholders != len(inputs):
        raise GraphFormatError(f"a graph has {len(inputs)} placeholders (one per input) and ends with its output "
                               f"node; this one has {placeholders} placeholders")
    return tuple(nodes)


def _parse_names(data: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    inputs = tuple(as_list(field(data, "inputs", ""), "inputs", lambda v, w: as_str(v, w, choices=INPUT_NAMES)))
    outputs = tuple(as_list(field(data, "outputs", ""), "outputs", as_str))
    if len(set(inputs)) != len(inputs) or "input_ids" not in inputs:
        raise GraphFormatError(f"inputs {list(inputs)} must name input_ids and each input at most once")
    try:
        expected = output_names(len(outputs))
    except ValueError as exc:
        raise GraphFormatError(str(exc)) from None
    if outputs != expected:
        raise GraphFormatError(f"outputs must be {list(expected)}, got {list(outputs)}")
    return inputs, outputs


def parse_program(data: Any, load_constant: Callable[[str], torch.Tensor], device_type: str = "cpu",
                  vocab_size: Optional[int] = None) -> ProgramSpec:
    """Check an `encode_program` dict completely; `load_constant(key)` returns the tensor stored under a key, and
    every tensor must live on `device_type` (the artifact's device type, the device a cache entry is loaded on).
    With `vocab_size` (token ids are checked to lie below it), the token embedding must have that many rows.

    Raises GraphFormatError naming the first problem. Nothing here runs code the file names.
    """
    try:
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise GraphFormatError(f"graph format {found!r}; this ttftc reads format {FORMAT_VERSION}"[:200])
        if set(data) != _PROGRAM_FIELDS:
            raise GraphFormatError(f"a graph has exactly the fields {sorted(_PROGRAM_FIELDS)}, got {sorted(data)}")
        signature = GraphSignature.from_dict(data["signature"])
        inputs, outputs = _parse_names(data)
        constants = _parse_constants(data["constants"], load_constant, device_type)
        nodes = _parse_nodes(data["nodes"], constants, inputs, outputs, device_type)
        spec = ProgramSpec(signature, inputs, outputs, nodes, constants)
        if vocab_size is not None:
            check_embedding_rows(spec, vocab_size)
    except GraphFormatError:
        raise
    except (SchemaError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError,
            OverflowError, RuntimeError) as exc:
        raise GraphFormatError(f"{type(exc).__name__}: {exc}"[:300]) from None
    return spec


def decode_program(data: Any, load_constant: Callable[[str], torch.Tensor], device_type: str = "cpu",
                   vocab_size: Optional[int] = None) -> GraphProgram:
    """Rebuild a program from `encode_program`'s dict: `parse_program`, then build it."""
    return parse_program(data, load_constant, device_type, vocab_size).build()
