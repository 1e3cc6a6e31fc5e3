"""Small, shared helpers for reading and rewriting aten FX graphs. Passes build their matchers from these; capture,
lowering and the code generators use them too, which is why they sit below all of them rather than in passes/."""

from __future__ import annotations

import operator
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.operator_schemas import normalize_function

aten = torch.ops.aten

# Ops that only re-describe a tensor's memory; looking through them keeps matchers independent of how a model
# happened to spell a reshape.
VIEW_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.squeeze.dim,
    aten.unsqueeze.default,
    aten.clone.default,
    aten.alias.default,
}


def is_call(node: Any, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def val(node: Any) -> Any:
    """The FakeTensor (or value) a node produces, from its metadata."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def tensor_meta_matches(a: Any, b: Any) -> bool:
    """True if two meta values have the same shape, dtype and device (symbolic sizes compared structurally)."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (
            isinstance(a, (list, tuple))
            and isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(tensor_meta_matches(x, y) for x, y in zip(a, b))
        )
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype != b.dtype or a.device != b.device or a.dim() != b.dim():
        return False
    return all(str(x) == str(y) for x, y in zip(a.shape, b.shape))


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """An independent copy of a graph, node metadata included (shallowly), owned by the same module."""
    copy = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


def fake_mode_of(gm: fx.GraphModule):
    """The fake mode of the graph's meta values (the tracing context's, when there is one).

    One fake value names it: every pass and lowering asks, often once per rewritten node, and scanning the whole
    graph each time made a compile quadratic in the model's depth."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, FakeTensor):
            return detect_fake_mode([value])
    return detect_fake_mode([])


def _to_meta(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return arg.meta["val"]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_to_meta(a) for a in arg)
    if isinstance(arg, dict):
        return {k: _to_meta(v) for k, v in arg.items()}
    return arg


def call(gm: fx.GraphModule, target, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
    """Insert `target(*args, **kwargs)` at the graph's current insert point, with `meta["val"]` filled in."""
    node = gm.graph.call_function(target, tuple(args), dict(kwargs or {}))
    refresh_meta(gm, node)
    return node


def refresh_meta(gm: fx.GraphModule, node: fx.Node) -> None:
    """Recompute `node.meta["val"]` from its (possibly new) target, e.g. after retargeting it."""
    with fake_mode_of(gm):
        node.meta["val"] = node.target(*_to_meta(node.args), **_to_meta(node.kwargs))


def inline_function(gm: fx.GraphModule, node: fx.Node, fn, decompositions: Optional[dict] = None) -> None:
    """Replace `node` by the graph of `fn(*node.args, **node.kwargs)`, traced on the meta values of its tensor
    arguments (custom ops `fn` calls stay single nodes). A tuple result re-points the node's getitem users."""
    flat, spec = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]

    def traced(*values):
        filled = list(flat)
        for i, value in zip(positions, values):
            filled[i] = value
        args, kwargs = torch.utils._pytree.tree_unflatten(filled, spec)
        out = fn(*args, **kwargs)
        return tuple(out) if isinstance(out, tuple) else out  # a named tuple would be traced as a constructor call

    with fake_mode_of(gm):
        sub = make_fx(traced, decomposition_table=decompositions)(*[flat[i].meta["val"] for i in positions])
    returns_tuple = isinstance(sub.graph.find_nodes(op="output")[0].args[0], (list, tuple))
    if returns_tuple and -1 in getitem_users(node):  # checked before the graph changes: nothing half-done
        raise ValueError(f"{node.name} returns a tuple that a user reads whole")
    env: dict[fx.Node, Any] = {}
    inputs = iter(flat[i] for i in positions)
    result: Any = None
    with gm.graph.inserting_before(node):
        for sub_node in sub.graph.nodes:
            if sub_node.op == "placeholder":
                env[sub_node] = next(inputs)
            elif sub_node.op == "output":
                result = fx.map_arg(sub_node.args[0], lambda n: env[n])
            elif sub_node.op == "get_attr":  # a constant the trace made (a scalar tensor): keep it on gm
                env[sub_node] = add_constant(gm, sub_node.target, getattr(sub, sub_node.target))
            else:
                env[sub_node] = gm.graph.node_copy(sub_node, lambda n: env[n])
    if returns_tuple:
        for index, users in getitem_users(node).items():
            for user in users:
                user.replace_all_uses_with(result[index])
                gm.graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    gm.graph.erase_node(node)


def add_constant(gm: fx.GraphModule, name_hint: str, tensor: torch.Tensor) -> fx.Node:
    """Register `tensor` on the module as a frozen constant and return a get_attr node for it."""
    base = "_ttftc_" + "".join(c if c.isalnum() else "_" for c in name_hint)
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    gm.register_buffer(name, tensor.detach(), persistent=False)
    node = gm.graph.get_attr(name)
    fake_mode = fake_mode_of(gm)
    # The fake reads only the constant's metadata, though through calls (its storage) that a torch-function mode
    # watching what a compile does with weight values (regions/recipe.py) could not tell from a read of the data.
    with torch._C.DisableTorchFunction():
        node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True) if fake_mode else tensor
    return node


def constant_value(gm: fx.GraphModule, node: Any) -> Optional[torch.Tensor]:
    """The concrete tensor behind a node if it is a frozen constant, else None."""
    if isinstance(node, fx.Node) and node.op == "get_attr":
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part, None)
            if value is None:
                return None
        return value if isinstance(value, torch.Tensor) else None
    return None


def transposed_constant(gm: fx.GraphModule, node: Any) -> Optional[torch.Tensor]:
    """For `aten.t(get_attr W)` or `aten.permute(W, [1, 0])`, the weight W as stored ([out, in]); else None."""
    if is_call(node, aten.t.default):
        return constant_value(gm, node.args[0])
    if is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]:
        return constant_value(gm, node.args[0])
    if is_call(node, aten.transpose.int) and sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]:
        return constant_value(gm, node.args[0])
    return None


def through_views(node: Any) -> Any:
    """Walk up a chain of view-like ops to the first node that computes something."""
    while is_call(node, *VIEW_OPS):
        node = node.args[0]
    return node


def users_through_views(node: fx.Node) -> list[fx.Node]:
    """The non-view users of `node`, looking through view-like ops with a single path."""
    result = []
    for user in node.users:
        if is_call(user, *VIEW_OPS):
            result.extend(users_through_views(user))
        else:
            result.append(user)
    return result


def only_user(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def scalar(arg: Any) -> Optional[float]:
    """A Python number argument, or None if it is a node or symbolic."""
    if isinstance(arg, bool):
        return None
    if isinstance(arg, (int, float)):
        return float(arg)
    return None


def static_int(x: Any) -> Optional[int]:
    """An int that does not depend on a symbolic size, or None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        node = x.node
        if node.is_constant() or not node.expr.free_symbols:
            return int(x)
    return None


def nodes_between(outputs: Iterable[fx.Node], inputs: Iterable[fx.Node]) -> set[fx.Node]:
    """All nodes on paths from `inputs` to `outputs` (inclusive of outputs, exclusive of inputs)."""
    stop = set(inputs)
    seen: set[fx.Node] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in seen or n in stop:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes)
    return seen


def has_outside_users(region: set[fx.Node], keep: Iterable[fx.Node]) -> Optional[fx.Node]:
    """A node of `region` (other than those in `keep`) read from outside the region, or None."""
    keep = set(keep)
    for n in region:
        if n in keep:
            continue
        for user in n.users:
            if user not in region:
                return n
    return None


def op_histogram(gm: fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_label(node.target)
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def op_label(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name.replace('::', '.')}"
    return getattr(target, "__name__", str(target))


def bound_arguments(node: fx.Node) -> Optional[dict]:
    """All arguments of an op node by schema name (defaults filled in), or None if they do not bind."""
    norm = normalize_function(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    if norm is None:
        return None
    bound = dict(norm.kwargs)
    for arg in node.target._schema.arguments:
        if arg.name not in bound and arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def getitem_users(node: fx.Node) -> dict[int, list[fx.Node]]:
    result: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            result.setdefault(int(user.args[1]), []).append(user)
        else:
            result.setdefault(-1, []).append(user)
    return result


def dtype_of(node: Any) -> Optional[torch.dtype]:
    value = val(node)
    return value.dtype if isinstance(value, torch.Tensor) else None

