"""Capture: Dynamo's torch-level FX graph → a functional aten inference graph with weights frozen as constants.

Dynamo lifts parameters and buffers to graph inputs and marks them static. Freezing them into the aten graph as
`get_attr` constants lets a pass transform a weight once at compile time (concatenate, transpose, quantize)
instead of on every call. Like Inductor's freezing, this assumes weights do not change after compile: recompile
after loading new weights.
"""

from __future__ import annotations

import functools
import json
import operator
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import sympy
import torch
import torch.fx as fx
from torch._dynamo import symbolic_convert
from torch.utils._sympy.functions import Max as SympyMax, Min as SympyMin

from ttftc.fx_utils import copy_graph

aten = torch.ops.aten


def is_weight(x) -> bool:
    # "unguarded" is how Dynamo marks the parameters and buffers of inlined nn.Modules. Tensors marked with
    # mark_static_address (e.g. a StaticCache) are "guarded" and may be mutated, so they stay inputs.
    return isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None) == "unguarded"


@dataclass(frozen=True)
class FlatInputs:
    """The inputs AOTAutograd will flatten, in its order, and which of them are weights."""

    tensors: tuple
    weight_indices: frozenset[int]


def flat_inputs(dynamo_gm: fx.GraphModule, example_inputs: Sequence) -> FlatInputs:
    # aot_module_simplified puts the module's own parameters and buffers first (non-empty only when Dynamo did
    # not lift them), then the user inputs.
    own = {
        **dict(dynamo_gm.named_parameters(remove_duplicate=False)),
        **dict(dynamo_gm.named_buffers(remove_duplicate=False)),
    }
    flat = tuple(own.values()) + tuple(example_inputs)
    weights = set(range(len(own)))
    weights.update(len(own) + i for i, x in enumerate(example_inputs) if is_weight(x))
    return FlatInputs(flat, frozenset(weights))


def freeze_weights(aten_gm: fx.GraphModule, inputs: FlatInputs, num_aot_inputs: int) -> tuple[list[int], str | None]:
    """Turn weight placeholders into constants, in place. Returns (indices of inputs still read, note)."""
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    if num_aot_inputs != len(inputs.tensors) or len(placeholders) != num_aot_inputs:
        # AOTAutograd deduplicated or added inputs; the index mapping is unknown, so nothing is frozen and
        # passes that need constant weights reject their matches.
        return list(range(num_aot_inputs)), (
            f"weights not frozen: AOTAutograd has {num_aot_inputs} inputs for {len(inputs.tensors)} flat inputs"
        )
    live = []
    for index, node in enumerate(placeholders):
        tensor = inputs.tensors[index]
        mutated = any(u.target is aten.copy_.default and u.args[0] is node for u in node.users)
        if index not in inputs.weight_indices or mutated or not isinstance(tensor, torch.Tensor):
            live.append(index)
            continue
        name = f"_frozen_{index}_{node.name}"
        aten_gm.register_buffer(name, tensor.detach(), persistent=False)
        with aten_gm.graph.inserting_before(node):
            const = aten_gm.graph.get_attr(name)
        const.meta.update(node.meta)
        node.replace_all_uses_with(const)
        aten_gm.graph.erase_node(node)
    # get_attr nodes must precede their users; placeholders came first, so they already do.
    aten_gm.graph.lint()
    aten_gm.recompile()
    return live, None


def weights_as_attributes(dynamo_gm: fx.GraphModule, inputs: Sequence,
                          weight_indices: Sequence[int]) -> tuple[fx.GraphModule, list[int]]:
    """A copy of Dynamo's graph that holds `inputs[i]` for i in `weight_indices` as module buffers read through
    get_attr, and the indices of the inputs it still takes.

    Dynamo lifts an inlined module's parameters to graph inputs; Inductor's freezing only folds tensors the graph
    module owns. Handing them back to the module is what lets Inductor freeze them, whatever Dynamo's settings
    were while it traced.
    """
    gm = fx.GraphModule(dynamo_gm, copy_graph(dynamo_gm.graph))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    chosen = set(weight_indices)
    live = []
    for index, node in enumerate(placeholders):
        if index not in chosen:
            live.append(index)
            continue
        name = f"_ttftc_weight_{index}"
        gm.register_buffer(name, inputs[index].detach(), persistent=False)
        with gm.graph.inserting_after(placeholders[-1]):  # placeholders stay first
            attr = gm.graph.get_attr(name)
        attr.meta.update(node.meta)
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm, live


def retrace_with_symbolic_lengths(example_inputs: Sequence) -> None:
    """Make Dynamo trace this frame again, now, with symbolic lengths, when that changes anything; else return.

    This is what Dynamo's automatic dynamic shapes does at the second distinct prompt length, done at the first:
    every dimension above 1 of a non-weight tensor input (the prompt length, a KV cache's past length), the batch
    dimension excepted, is marked `maybe_mark_dynamic`, so a weight-pinned size (the hidden size) or a size the model branches on specialises
    back to a constant during the retrace, and the frame restarts. A model compiled this way never compiles again
    for a new prompt length, where the static first graph would be thrown away at the next length and compiled again
    (benchmarks/README.md, start-up).

    The restart uses two Dynamo internals, checked for and skipped (compiling the static graph) when missing: the
    one restart exception that Dynamo lets a backend raise (its float-tensorify pass uses it the same way), and
    clearing the speculation log, as Dynamo does itself before a restart whose retrace may take another path.
    """
    if _has_symbolic_sizes(example_inputs) or not _mark_lengths_dynamic(example_inputs):
        return
    restart = getattr(torch._dynamo.exc, "TensorifyScalarRestartAnalysis", None)
    try:
        tx = symbolic_convert.InstructionTranslator.current_tx()
        speculation_log = tx.speculation_log
    except (ImportError, AttributeError, AssertionError):
        return
    if restart is None or not hasattr(speculation_log, "clear"):
        return
    speculation_log.clear()
    raise restart(restart_reason="ttftc: retrace with symbolic sequence lengths")


def _mark_lengths_dynamic(example_inputs: Sequence) -> bool:
    marked = False
    for x in example_inputs:
        if not isinstance(x, torch.Tensor) or is_weight(x) or isinstance(x, torch._subclasses.FakeTensor):
            continue
        already = getattr(x, "_dynamo_weak_dynamic_indices", set()) | getattr(x, "_dynamo_dynamic_indices", set())
        first = 1 if x.dim() >= 2 else 0  # the batch stays static: a new batch size is Dynamo's to handle
        for dim, size in enumerate(x.shape):
            if dim >= first and isinstance(size, int) and size > 1 and dim not in already:
                torch._dynamo.maybe_mark_dynamic(x, dim)
                marked = True
    return marked


def _has_symbolic_sizes(example_inputs: Sequence) -> bool:
    return any(isinstance(x, torch.SymInt) for x in example_inputs) or any(
        isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape) for x in example_inputs
    )


# -- what a graph cache needs from a capture -------------------------------------------------------------------
# A dynamic-shape graph is cached the way Inductor's FX graph cache does it: Dynamo still traces in every process (its
# guards stay the check that a call fits the graph), and the compiled graph is looked up by a description of Dynamo's
# graph. What the compile itself assumed about the symbolic sizes (the guards it added to the shape environment) is
# stored with it as data, and asserted again on the sizes of the graph that loads it.

# A compile adds a few guards per layer (bounds on each layer's KV buffers: a 30-layer model's continuation graph
# passes 256); a stored entry with far more than a large model's is not one ttftc wrote.
MAX_GUARDS = 8192
_GUARD_DEPTH = 16
_INT_LIMIT = 1 << 62  # integers in a stored guard; sizes are far smaller
_RELATIONS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
              "ge": operator.ge}
_TERM_FUNCTIONS = {"add": operator.add, "mul": operator.mul, "max": torch.sym_max, "min": torch.sym_min}
_SYMPY_RELATIONS = {sympy.Eq: "eq", sympy.Ne: "ne", sympy.Lt: "lt", sympy.Le: "le", sympy.Gt: "gt", sympy.Ge: "ge"}


class GuardError(ValueError):
    """A stored guard is not one of the few shapes a capture writes."""


@dataclass(frozen=True)
class GraphDescription:
    """Dynamo's graph as a cache key sees it, and how to reach its symbolic sizes.

    text:            JSON-able and canonical: the graph's code, each input's kind/dtype/shape/strides (symbols by
                     name), and the guards Dynamo had installed when it handed the graph over.
    symbols:         symbol name -> the input it is (("input", i)) or a size of (("size", i, dim)).
    input_kinds:     "tensor", "symint" or "constant" per input, in order.
    token_id_inputs: inputs that carry token ids, those Dynamo named after an `input_ids` argument (an embedding they
                     index must have a row for each id the server admits: a stored graph is checked for it).
    """

    text: dict
    symbols: dict
    input_kinds: tuple[str, ...]
    token_id_inputs: tuple[int, ...]
    values: tuple = ()  # the example values (fake tensors, SymInts) the symbols are read from; not part of the key
    outputs: Optional[int] = None  # how many values the graph returns

    def symbol_value(self, where: tuple):
        value = self.values[where[1]]
        return value if where[0] == "input" else value.shape[where[2]]


def describe_dynamo_graph(gm: fx.GraphModule, example_inputs: Sequence) -> Optional[GraphDescription]:
    """The description of a graph whose meaning its code and inputs fully give, or None: a graph that calls
    submodules, reads attributes of its own or whose inputs Dynamo did not annotate is not described (not cached)."""
    if any(n.op in ("call_module", "get_attr") for n in gm.graph.nodes) or next(gm.parameters(), None) is not None \
            or next(gm.buffers(), None) is not None:
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return None
    inputs, symbols, kinds, ids, values = [], {}, [], [], []
    for index, (node, example) in enumerate(zip(placeholders, example_inputs)):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    symbols.setdefault(str(size.node.expr), ("size", index, dim))
            entry = {"tensor": [str(value.dtype), [str(s) for s in value.shape], [str(s) for s in value.stride()],
                                value.device.type, bool(value.requires_grad), is_weight(example)]}
            kinds.append("tensor")
            if "input_ids" in node.name:
                ids.append(index)
        elif isinstance(value, torch.SymInt):
            if isinstance(value.node.expr, sympy.Symbol):
                symbols[str(value.node.expr)] = ("input", index)
            entry = {"symint": str(value.node.expr)}
            kinds.append("symint")
        elif type(value) in (int, float, bool):
            entry = {"constant": repr(value)}
            kinds.append("constant")
        else:
            return None
        inputs.append([node.name, entry])
        values.append(value)
    shape_env = _shape_env()
    entry_guards = [str(g.expr) for g in shape_env.guards] if shape_env is not None else []
    text = {"code": gm.code, "inputs": inputs, "guards": entry_guards}
    result = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = len(result) if isinstance(result, (tuple, list)) else None
    return GraphDescription(text, symbols, tuple(kinds), tuple(ids), tuple(values), outputs)


def _shape_env():
    context = torch._guards.TracingContext.try_get()
    mode = getattr(context, "fake_mode", None) if context is not None else None
    return getattr(mode, "shape_env", None)


class GuardWatch:
    """What a compile adds to Dynamo's shape environment: `added()` is the new guards, encoded, or None when the
    compile changed the environment in a way a stored guard cannot say (a runtime assert, a guard of an unknown form).

    A guard that pins a size (`Eq(s0, 0)`) also replaces the symbol by its value; a symbol replaced during the compile
    is stored as that equality, which asserted again on a later trace makes the same replacement."""

    def __init__(self):
        self.shape_env = _shape_env()
        env = self.shape_env
        if env is not None:
            self._guards, self._replacements = len(env.guards), dict(env.replacements)
            self._asserts = _assert_count(env)

    def added(self, description: GraphDescription) -> Optional[list]:
        env = self.shape_env
        if env is None:
            return []
        if _assert_count(env) != self._asserts:
            return None
        # A symbol replaced before the compile and now by something else follows a symbol its old value named (s49
        # was s54, s54 is now 0): the root's replacement is what gets stored.
        replaced = [sympy.Eq(symbol, value) for symbol, value in env.replacements.items()
                    if symbol not in self._replacements]
        try:
            encoded = [guard for expr in [g.expr for g in env.guards[self._guards:]] + replaced
                       for guard in encode_guards(expr, description.symbols)]
        except GuardError:
            return None
        unique = list({json.dumps(g, sort_keys=True): g for g in encoded}.values())
        return unique if len(unique) <= MAX_GUARDS else None


def _assert_count(env) -> int:
    return sum(len(v) for v in env.deferred_runtime_asserts.values())


def encode_guards(expr, symbols: dict) -> list:
    """A guard (a comparison, or a conjunction of comparisons, of sums, products, maxima and minima of the graph's
    symbols and integers) as a list of JSON comparisons, all of which it asserts."""
    if isinstance(expr, sympy.And):
        return [g for arg in expr.args for g in encode_guards(arg, symbols)]
    for relation, name in _SYMPY_RELATIONS.items():
        if isinstance(expr, relation):
            return [{name: [_encode_term(a, symbols) for a in expr.args]}]
    raise GuardError(f"guard {expr} is not a comparison")


_SYMPY_TERMS = ((sympy.Add, "add"), (sympy.Mul, "mul"), (SympyMax, "max"), (SympyMin, "min"), (sympy.Max, "max"),
                (sympy.Min, "min"))


def _encode_term(expr, symbols: dict) -> Any:
    if isinstance(expr, sympy.Integer) and abs(int(expr)) < _INT_LIMIT:
        return int(expr)
    if isinstance(expr, sympy.Symbol) and str(expr) in symbols:
        return {"symbol": list(symbols[str(expr)])}
    for kind, name in _SYMPY_TERMS:
        if isinstance(expr, kind):
            return {name: [_encode_term(a, symbols) for a in expr.args]}
    raise GuardError(f"guard term {expr} is not an integer, an input's size or a sum, product, max or min of them")


def guards_hold(guards: Any, description: GraphDescription) -> bool:
    """Assert each stored guard on the sizes of `description` (Dynamo records each as a guard of its own, as it does
    for the compile that stored them); False at the first that does not hold here, or for a malformed list."""
    try:
        for guard in check_guards(guards, description):
            (name, (left, right)), = guard.items()
            if not bool(_RELATIONS[name](_evaluate(left, description), _evaluate(right, description))):
                return False
    except Exception:  # a malformed entry, or a size Dynamo cannot compare here: compile instead
        return False
    return True


def check_guards(guards: Any, description: GraphDescription) -> list:
    """The stored guard list, checked for its shape: comparisons of terms over this graph's inputs (GuardError)."""
    if not isinstance(guards, list) or len(guards) > MAX_GUARDS:
        raise GuardError(f"guards must be a list of at most {MAX_GUARDS}")
    for guard in guards:
        if not isinstance(guard, dict) or len(guard) != 1:
            raise GuardError("a guard is a one-key object")
        (name, operands), = guard.items()
        if name not in _RELATIONS or not isinstance(operands, list) or len(operands) != 2:
            raise GuardError(f"guard {name!r} is not a comparison of two terms"[:120])
        for term in operands:
            _check_term(term, description, 0)
    return guards


def _check_term(term: Any, description: GraphDescription, depth: int) -> None:
    if depth > _GUARD_DEPTH:
        raise GuardError(f"a guard nests deeper than {_GUARD_DEPTH}")
    if type(term) is int:
        if abs(term) >= _INT_LIMIT:
            raise GuardError("a guard's integer is out of range")
        return
    if not isinstance(term, dict) or len(term) != 1:
        raise GuardError(f"guard term {term!r} is not an integer or a one-key object"[:120])
    (kind, value), = term.items()
    if kind == "symbol":
        where = tuple(value) if isinstance(value, list) else None
        if where not in set(description.symbols.values()):
            raise GuardError(f"guard names {value!r}, which is no symbolic size of this graph's inputs"[:120])
        return
    if kind not in _TERM_FUNCTIONS or not isinstance(value, list) or not 2 <= len(value) <= 64:
        raise GuardError(f"guard term {kind!r} is not a sum, product, max or min of 2 to 64 terms"[:120])
    for part in value:
        _check_term(part, description, depth + 1)


def _evaluate(term: Any, description: GraphDescription):
    if type(term) is int:
        return term
    (kind, value), = term.items()
    if kind == "symbol":
        return description.symbol_value(tuple(value))
    return functools.reduce(_TERM_FUNCTIONS[kind], [_evaluate(p, description) for p in value])
