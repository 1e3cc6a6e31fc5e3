"""A compiled prefill graph as data: nodes as JSON, constants as tensors referenced by key.

What is saved is the graph after ttftc's passes and lowering, so loading it runs neither: the graph is
rebuilt node by node and called directly. Targets are named, never pickled: aten/ttftc ops by their qualified
op name, lowered provider functions by "module:qualname", and only from modules under ttftc, torch and
operator, so loading a file cannot import arbitrary code.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from ttftc.buckets.program import GraphProgram, GraphSignature

FORMAT_VERSION = 1
_TRUSTED_MODULES = ("ttftc.", "torch.", "torch", "operator", "_operator", "math")


class GraphFormatError(ValueError):
    """A graph cannot be saved (an unsupported target or argument) or a saved graph cannot be read."""


# -- targets ------------------------------------------------------------------------------------------------
def _encode_target(target: Any) -> dict:
    if isinstance(target, torch._ops.OpOverload):
        return {"op": f"{target.namespace}::{target._opname}.{target._overloadname}"}
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if callable(target) and module and qualname and "<" not in qualname:
        if not module.startswith(_TRUSTED_MODULES):
            raise GraphFormatError(f"graph calls {module}.{qualname}, outside ttftc/torch/operator: not saved")
        if _resolve_function(f"{module}:{qualname}") is not target:
            raise GraphFormatError(f"graph target {module}.{qualname} does not resolve back to itself")
        return {"fn": f"{module}:{qualname}"}
    raise GraphFormatError(f"graph target {target!r} cannot be saved")


def _resolve_function(name: str) -> Callable:
    module_name, _, qualname = name.partition(":")
    if not module_name.startswith(_TRUSTED_MODULES):
        raise GraphFormatError(f"refusing to import {module_name!r}: only ttftc, torch and operator functions load")
    value: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def _resolve_op(name: str) -> torch._ops.OpOverload:
    namespace, _, rest = name.partition("::")
    opname, _, overload = rest.rpartition(".")
    if namespace == "ttftc":
        import ttftc.ops  # noqa: F401  (registers torch.ops.ttftc.*)
    try:
        return getattr(getattr(getattr(torch.ops, namespace), opname), overload)
    except (AttributeError, RuntimeError) as exc:
        raise GraphFormatError(f"op {name} does not exist in this torch/ttftc") from exc


def _decode_target(data: dict) -> Any:
    if "op" in data:
        return _resolve_op(data["op"])
    if "fn" in data:
        try:
            return _resolve_function(data["fn"])
        except (ImportError, AttributeError) as exc:
            raise GraphFormatError(f"function {data['fn']} does not exist in this ttftc/torch") from exc
    raise GraphFormatError(f"unknown target encoding {data}")


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


def _decode_arg(arg: Any, env: Mapping[str, fx.Node]) -> Any:
    if isinstance(arg, list):
        return [_decode_arg(a, env) for a in arg]
    if not isinstance(arg, dict):
        return arg
    (kind, value), = arg.items()
    if kind == "node":
        return env[value]
    if kind == "tuple":
        return tuple(_decode_arg(a, env) for a in value)
    if kind == "dict":
        return {k: _decode_arg(v, env) for k, v in value.items()}
    if kind == "float":
        return float(value)
    if kind in ("dtype", "layout", "memory_format"):
        result = getattr(torch, value, None)
        if result is None:
            raise GraphFormatError(f"unknown torch.{value}")
        return result
    if kind == "device":
        return torch.device(value)
    raise GraphFormatError(f"unknown argument encoding {arg}")


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


def encode_program(program: GraphProgram, constant_key: Callable[[torch.Tensor], str]) -> dict:
    """The program as a JSON-able dict; `constant_key` names each constant tensor (e.g. by content)."""
    nodes = []
    for node in program.gm.graph.nodes:
        entry: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            entry["target"] = _encode_target(node.target)
        elif node.op == "get_attr":
            if "." in node.target:
                raise GraphFormatError(f"nested constant {node.target} is not supported")
            entry["target"] = node.target
        elif node.op not in ("placeholder", "output"):
            raise GraphFormatError(f"{node.op} node {node.name} cannot be saved (graphs are flat aten graphs)")
        if node.op in ("call_function", "output"):
            entry["args"] = _encode_arg(tuple(node.args))
            entry["kwargs"] = _encode_arg(dict(node.kwargs))
        nodes.append(entry)
    constants = {}
    for name, tensor in graph_constants(program.gm).items():
        if not _dense(tensor):
            raise GraphFormatError(f"constant {name} has overlapping strides {tensor.stride()}; cannot be saved")
        constants[name] = {
            "key": constant_key(tensor), "shape": list(tensor.shape), "stride": list(tensor.stride()),
            "dtype": str(tensor.dtype).removeprefix("torch."),
        }
    return {
        "format": FORMAT_VERSION,
        "signature": program.signature.to_dict(),
        "inputs": list(program.inputs),
        "outputs": list(program.outputs),
        "nodes": nodes,
        "constants": constants,
    }


def _dense(t: torch.Tensor) -> bool:
    """Every element has its own memory and there are no holes: a permutation of a contiguous layout, so the
    tensor can be rebuilt from its contiguous data plus its strides."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _restride(t: torch.Tensor, shape: list, stride: list) -> torch.Tensor:
    if tuple(t.stride()) == tuple(stride):
        return t
    out = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def decode_program(data: dict, load_constant: Callable[[str], torch.Tensor]) -> GraphProgram:
    """Rebuild a program from `encode_program`'s dict; `load_constant(key)` returns the tensor for a key."""
    if data.get("format") != FORMAT_VERSION:
        raise GraphFormatError(f"graph format {data.get('format')!r}; this ttftc reads format {FORMAT_VERSION}")
    root = torch.nn.Module()
    for name, meta in data["constants"].items():
        tensor = load_constant(meta["key"])
        if list(tensor.shape) != list(meta["shape"]) or str(tensor.dtype).removeprefix("torch.") != meta["dtype"]:
            raise GraphFormatError(
                f"constant {name}: stored tensor is {tuple(tensor.shape)} {tensor.dtype}, the graph wants "
                f"{tuple(meta['shape'])} {meta['dtype']}"
            )
        root.register_buffer(name, _restride(tensor, meta["shape"], meta["stride"]), persistent=False)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for entry in data["nodes"]:
        op = entry["op"]
        if op == "placeholder":
            node = graph.placeholder(entry["name"])
        elif op == "get_attr":
            node = graph.get_attr(entry["target"])
        elif op == "call_function":
            node = graph.call_function(
                _decode_target(entry["target"]), _decode_arg(entry["args"], env), _decode_arg(entry["kwargs"], env)
            )
        elif op == "output":
            (result,) = _decode_arg(entry["args"], env)
            node = graph.output(result)
        else:
            raise GraphFormatError(f"unknown node kind {op!r}")
        env[entry["name"]] = node
    gm = fx.GraphModule(root, graph)
    return GraphProgram(GraphSignature.from_dict(data["signature"]), gm, data["inputs"], data["outputs"])

