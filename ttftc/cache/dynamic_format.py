"""A compiled graph with symbolic sizes as data: the KV path's graphs, which serve every prompt and KV length.

The bucket graphs (graph_format.py) have concrete shapes and a fixed set of named inputs. A graph Dynamo traced with
dynamic shapes instead takes Dynamo's inputs by position, some of them sizes (ints at run time), passes sizes on to
ops (`aten.view(x, [s0, 128])`, `aten.arange(s0)`), computes new ones (`s0 + s1`) and may return sizes. So this
format adds, to everything graph_format checks (allow-listed targets checked against their schemas, identifiers,
typed arguments, constants of declared shape on the graph's device, the token embedding's rows):

- each placeholder's kind, taken from the graph that loads it (a tensor or an int), never from the file;
- size arithmetic, allow-listed (graph_calls.py: + - * // % and negation, and `aten.sym_size`), each op wrapped so
  that a result outside int64 raises instead of growing without bound;
- a size accepted where the op's schema takes a SymInt or a Scalar, and nowhere else;
- the autotuned lowerings of a symbolic graph (`{"tuned": ...}`), rebuilt as per-shape lookups of the autotune cache;
- outputs that are tensors or sizes, as many as the loading graph returns;
- the guards its compile added (capture.encode_guards), checked for their shape here and asserted on the loading
  graph's sizes by the backend;
- per output, the dims AOTAutograd's wrapper marks dynamic for the next graph (the one thing that wrapper does for
  a graph the backend stores), distinct and below 64.

Nothing in the file becomes code: names are identifiers, targets come from tables.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
import torch.fx as fx

from ttftc.capture import GraphDescription, GuardError, check_guards
from ttftc.cache.graph_calls import (SYMINT, TENSOR, GraphFormatError, Produces, Ref, check_call, encode_target,
                                     resolve_target, tuned_target)
from ttftc.cache.graph_format import (_ConstantSpec, _NodeSpec, _decode_arg, _dense, _encode_arg, _identifier,
                                      _parse_constants, build_graph_module, graph_constants,
                                      node_kind_and_name)
from ttftc.cache.graph_vocab import check_embedding_rows
from ttftc.cache.schema import SchemaError, as_dict, as_int, as_list

DYNAMIC_FORMAT = 2
MAX_NODES = 200_000  # a 100-layer model's graph has a few thousand; the file's size limit bounds it as well
_FIELDS = {"format", "inputs", "outputs", "nodes", "constants", "guards", "dynamic_dims"}
_NODE_FIELDS = {
    "placeholder": {"name", "op"},
    "get_attr": {"name", "op", "target"},
    "call_function": {"name", "op", "target", "args", "kwargs"},
    "output": {"name", "op", "args"},
}


class DynamicSpec(NamedTuple):
    """A stored dynamic graph after every check (what graph_vocab reads: nodes and constants)."""

    inputs: tuple[int, ...]  # positions, among the loading graph's inputs, of the placeholders
    nodes: tuple[_NodeSpec, ...]
    constants: Mapping[str, _ConstantSpec]
    guards: list
    dynamic_dims: tuple  # per output: the dims AOTAutograd marked dynamic, or None

    def build(self) -> fx.GraphModule:
        return build_graph_module(self.constants, self.nodes, lambda args: args)


def encode_dynamic(gm: fx.GraphModule, live_inputs: tuple[int, ...], guards: list, dynamic_dims: tuple,
                   description: GraphDescription, constant_key: Callable[[torch.Tensor], str],
                   device_type: str) -> dict:
    """The lowered graph `gm` (placeholders: Dynamo's inputs at `live_inputs`) as a JSON-able dict, checked exactly as
    a reader checks it, so a graph that saves also loads (GraphFormatError otherwise)."""
    nodes = []
    for node in gm.graph.nodes:
        entry: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            entry["target"] = encode_target(node.target)
            entry["args"] = _encode_arg(tuple(node.args))
            entry["kwargs"] = _encode_arg(dict(node.kwargs))
        elif node.op == "get_attr":
            entry["target"] = node.target
        elif node.op == "output":
            if node.kwargs:
                raise GraphFormatError("the output node has keyword arguments")
            result = node.args[0] if len(node.args) == 1 else None
            entry["args"] = _encode_arg(tuple(result) if isinstance(result, list) else result)
        elif node.op != "placeholder":
            raise GraphFormatError(f"{node.op} node {node.name} cannot be saved (graphs are flat aten graphs)")
        nodes.append(entry)
    constants, by_key = {}, {}
    for name, tensor in graph_constants(gm).items():
        if not _dense(tensor.shape, tensor.stride()):
            raise GraphFormatError(f"constant {name} has overlapping strides {tensor.stride()}; cannot be saved")
        key = constant_key(tensor)
        by_key[key] = tensor
        constants[name] = {"key": key, "shape": list(tensor.shape), "stride": list(tensor.stride()),
                           "dtype": str(tensor.dtype).removeprefix("torch.")}
    encoded = {"format": DYNAMIC_FORMAT, "inputs": list(live_inputs), "outputs": _output_count(gm), "nodes": nodes,
               "constants": constants, "guards": guards,
               "dynamic_dims": [list(d) if d is not None else None for d in dynamic_dims]}
    try:
        parse_dynamic(encoded, by_key.__getitem__, device_type, description)
    except GraphFormatError as exc:
        raise GraphFormatError(f"the graph cannot be saved: {exc}") from None
    return encoded


def _output_count(gm: fx.GraphModule) -> int:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    result = output.args[0] if output.args else None
    if not isinstance(result, (tuple, list)):
        raise GraphFormatError("the graph does not return a tuple of values")
    return len(result)


def _kinds(data: Any, description: GraphDescription) -> tuple[tuple[int, ...], list[Produces]]:
    """The placeholders' input positions (strictly increasing) and what each is, as the loading graph says."""
    count = len(description.input_kinds)
    inputs = tuple(as_list(data, "inputs", lambda v, w: as_int(v, w, minimum=0)))
    if any(a >= b for a, b in zip(inputs, inputs[1:])) or (inputs and inputs[-1] >= count):
        raise GraphFormatError(f"inputs {list(inputs)[:20]} are not increasing positions among this graph's "
                               f"{count} inputs")
    produced = []
    for index in inputs:
        kind = description.input_kinds[index]
        if kind == "constant" and type(description.values[index]) is not int:
            raise GraphFormatError(f"input {index} is a non-integer constant; a stored graph does not read it")
        produced.append(TENSOR if kind == "tensor" else SYMINT)
    return inputs, produced


def _parse_nodes(data: Any, constants: Mapping[str, _ConstantSpec], kinds: list[Produces], outputs: int,
                 device_type: str) -> tuple[_NodeSpec, ...]:
    entries = as_list(data, "nodes", lambda v, w: as_dict(v, w))
    if len(entries) > MAX_NODES:
        raise GraphFormatError(f"a graph has at most {MAX_NODES} nodes, this one {len(entries)}")
    nodes: list[_NodeSpec] = []
    produced: dict[str, Produces] = {}
    placeholders = 0
    for i, entry in enumerate(entries):
        kind, name = node_kind_and_name(i, entry, nodes, produced, _NODE_FIELDS)
        if kind == "placeholder":
            if placeholders >= len(kinds) or any(n.kind == "call_function" for n in nodes):
                raise GraphFormatError(f"nodes[{i}]: placeholders precede every call, one per stored input "
                                       f"({len(kinds)})")
            produced[name] = kinds[placeholders]
            placeholders += 1
            nodes.append(_NodeSpec(kind, name))
        elif kind == "get_attr":
            target = _identifier(entry["target"], f"node {name}: constant")
            if target not in constants:
                raise GraphFormatError(f"node {name} reads constant {target}, which the graph does not declare")
            produced[name] = TENSOR
            nodes.append(_NodeSpec(kind, name, target))
        elif kind == "call_function":
            callee = resolve_target(entry["target"], symbolic=True)
            args = _decode_arg(entry["args"], produced, device_type)
            kwargs = _decode_arg(entry["kwargs"], produced, device_type)
            if not isinstance(args, tuple) or not isinstance(kwargs, dict):
                raise GraphFormatError(f"node {name}: args must be a tuple encoding and kwargs a dict encoding")
            for keyword in kwargs:
                _identifier(keyword, f"node {name}: keyword argument")
            produced[name] = check_call(callee, args, kwargs, produced, f"node {name}")
            target = tuned_target(callee, device_type) if callee.target is None else callee.target
            nodes.append(_NodeSpec(kind, name, target, args, kwargs))
        else:
            result = _decode_arg(entry["args"], produced, device_type)
            if (not isinstance(result, tuple) or len(result) != outputs
                    or not all(isinstance(r, Ref) and produced[r.name] in (TENSOR, SYMINT) for r in result)):
                raise GraphFormatError(f"the output node must return {outputs} tensor or size nodes")
            nodes.append(_NodeSpec(kind, name, None, result))
            produced[name] = TENSOR
    if not nodes or nodes[-1].kind != "output" or placeholders != len(kinds):
        raise GraphFormatError(f"a graph has {len(kinds)} placeholders (one per stored input) and ends with its "
                               f"output node; this one has {placeholders} placeholders")
    return tuple(nodes)


def _dynamic_dims(data: Any, output: _NodeSpec) -> tuple:
    """Per output, null or the distinct dims (of a tensor output, below its 64 dims at most) to mark dynamic."""
    if not isinstance(data, list) or len(data) != len(output.args):
        raise GraphFormatError(f"dynamic_dims must list one entry per output ({len(output.args)})")
    dims = []
    for i, entry in enumerate(data):
        if entry is not None:
            entry = as_list(entry, f"dynamic_dims[{i}]", lambda v, w: as_int(v, w, minimum=0))
            if len(set(entry)) != len(entry) or any(d >= 64 for d in entry):
                raise GraphFormatError(f"dynamic_dims[{i}] must be distinct dims below 64, got {entry[:8]}")
            entry = tuple(entry)
        dims.append(entry)
    return tuple(dims)


def parse_dynamic(data: Any, load_constant: Callable[[str], torch.Tensor], device_type: str,
                  description: GraphDescription, vocab_size: Optional[int] = None,
                  outputs: Optional[int] = None) -> DynamicSpec:
    """Check an `encode_dynamic` dict completely against the graph that loads it (`description`): `outputs`, when
    given, is how many values that graph returns; with `vocab_size`, every embedding its token-id inputs index has
    that many rows. Raises GraphFormatError naming the first problem; nothing here runs code the file names."""
    try:
        if not isinstance(data, dict) or data.get("format") != DYNAMIC_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise GraphFormatError(f"graph format {found!r}; this ttftc reads format {DYNAMIC_FORMAT} here"[:200])
        if set(data) != _FIELDS:
            raise GraphFormatError(f"a graph has exactly the fields {sorted(_FIELDS)}, got {sorted(data)}"[:300])
        inputs, kinds = _kinds(data["inputs"], description)
        count = as_int(data["outputs"], "outputs", minimum=1)
        if outputs is not None and count != outputs:
            raise GraphFormatError(f"the graph returns {count} values, Dynamo's graph {outputs}")
        constants = _parse_constants(data["constants"], load_constant, device_type)
        nodes = _parse_nodes(data["nodes"], constants, kinds, count, device_type)
        guards = check_guards(data["guards"], description)
        spec = DynamicSpec(inputs, nodes, constants, guards, _dynamic_dims(data["dynamic_dims"], nodes[-1]))
        if vocab_size is not None:
            names = [n.name for n in nodes if n.kind == "placeholder"]
            ids = {names[inputs.index(i)] for i in description.token_id_inputs if i in inputs}
            check_embedding_rows(spec, vocab_size, ids)
    except GraphFormatError:
        raise
    except GuardError as exc:
        raise GraphFormatError(f"guards: {exc}"[:300]) from None
    except (SchemaError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError,
            OverflowError, RuntimeError) as exc:
        raise GraphFormatError(f"{type(exc).__name__}: {exc}"[:300]) from None
    return spec
