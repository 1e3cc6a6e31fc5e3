"""Matchers shared by the ffn and norm_linear passes: linear layers, row-preserving views, activations, and
weights that fold to constants.

A linear in the aten graph is `mm(x2d, t(W))` or `addmm(b, x2d, t(W))` (nn.Linear, W stored [N, K]) or
`addmm(b, x2d, W)` (GPT-2's Conv1D, W stored [K, N]). Either way `LinearMatch.weight` is the [N, K] matrix
F.linear wants, so callers never care which spelling the model used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from ttftc import fx_utils as gu

aten = torch.ops.aten

# View ops that keep every row of the last dimension intact (they only regroup the leading dimensions).
_ROW_VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
                 aten.clone.default, aten.unsqueeze.default, aten.squeeze.dim}
_RESHAPE_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


@dataclass
class LinearMatch:
    node: fx.Node  # the mm / addmm
    x: fx.Node  # its 2-D activation argument
    weight: torch.Tensor  # [N, K], as F.linear wants it
    bias: Optional[torch.Tensor]
    # The get_attr node holding `weight` in [N, K] layout, when there is one (nn.Linear); None for Conv1D.
    weight_node: Optional[fx.Node]
    bias_node: Optional[fx.Node]

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


def match_linear(gm: fx.GraphModule, node: Any) -> Optional[LinearMatch]:
    """A linear layer with frozen weights at `node`, or None."""
    if gu.is_call(node, aten.mm.default) and not node.kwargs:
        bias_node, x, w_arg = None, node.args[0], node.args[1]
    elif gu.is_call(node, aten.addmm.default) and not node.kwargs and len(node.args) == 3:
        bias_node, x, w_arg = node.args
    else:
        return None
    weight = gu.transposed_constant(gm, w_arg)
    weight_node = w_arg.args[0] if weight is not None else None
    if weight is None:
        stored = gu.constant_value(gm, w_arg)  # Conv1D: stored [K, N]
        if stored is None:
            return None
        weight = stored.t()
    if weight.dim() != 2:
        return None
    bias = None
    if bias_node is not None:
        bias = gu.constant_value(gm, bias_node)
        if bias is None or bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            return None
    x_val = gu.val(x)
    if not isinstance(x_val, torch.Tensor) or x_val.dim() != 2:
        return None
    return LinearMatch(node, x, weight, bias, weight_node, bias_node)


def _is_full_slice(node: Any) -> bool:
    """`x[:, 0:]`-style slices that keep everything (how `logits_to_keep=0` traces under dynamic shapes)."""
    if not gu.is_call(node, aten.slice.Tensor):
        return False
    start = node.args[2] if len(node.args) > 2 else 0
    step = node.args[4] if len(node.args) > 4 else 1
    return start in (0, None) and step == 1 and str(gu.val(node).shape) == str(gu.val(node.args[0]).shape)


def is_row_view(node: Any) -> bool:
    """A view-like node that keeps rows intact: same last dimension, same number of elements."""
    if not (gu.is_call(node, *_ROW_VIEW_OPS) or _is_full_slice(node)):
        return False
    src, out = gu.val(node.args[0]), gu.val(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or src.dim() == 0 or out.dim() == 0:
        return False
    return str(src.shape[-1]) == str(out.shape[-1]) and str(src.numel()) == str(out.numel())


def up_row_views(node: Any) -> tuple[Any, list[fx.Node]]:
    """Walk up through row views: (the first node that computes something, the views passed)."""
    chain = []
    while is_row_view(node):
        chain.append(node)
        node = node.args[0]
    return node, chain


def row_view_users(node: fx.Node) -> Optional[list[fx.Node]]:
    """The non-view users of `node` reached through row views only, or None if some view is not a row view."""
    result = []
    for user in node.users:
        if is_row_view(user):
            inner = row_view_users(user)
            if inner is None:
                return None
            result.extend(inner)
        elif gu.is_call(user, *gu.VIEW_OPS, aten.slice.Tensor):
            return None  # a view that regroups or drops rows: not something a fused GEMM can read
        else:
            result.append(user)
    return result


def reshape_shape(node: fx.Node) -> Optional[list]:
    """The shape argument of a view/reshape node (may hold SymInt nodes), or None for other view ops."""
    if gu.is_call(node, *_RESHAPE_OPS) and isinstance(node.args[1], (list, tuple)):
        return list(node.args[1])
    return None


def tensor_region(outputs: list[fx.Node], stop: list[fx.Node]) -> set[fx.Node]:
    """Nodes on tensor paths from `stop` to `outputs` (outputs included, stop and get_attr constants excluded).

    Symbolic sizes (SymInt placeholders, sym_size nodes) feed view shapes; they are not data the pattern reads,
    so the walk does not follow them.
    """
    stop_set = set(stop)
    seen: set[fx.Node] = set()
    pending = list(outputs)
    while pending:
        node = pending.pop()
        if node in seen or node in stop_set or node.op == "get_attr":
            continue
        if not isinstance(gu.val(node), (torch.Tensor, tuple, list)):
            continue
        seen.add(node)
        pending.extend(node.all_input_nodes)
    return seen


def copy_provenance(new: fx.Node, old: fx.Node) -> None:
    """Carry the module path and source location over, so later passes (quant_skip) and explain can name it."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in old.meta and key not in new.meta:
            new.meta[key] = old.meta[key]


# -- activations ------------------------------------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _close(a: Any, b: float) -> bool:
    value = gu.scalar(a)
    return value is not None and abs(value - b) <= 1e-6 * max(1.0, abs(b))


def _mul_operands(node: Any) -> Optional[tuple[Any, Any]]:
    return (node.args[0], node.args[1]) if gu.is_call(node, aten.mul.Tensor) and not node.kwargs else None


def _cube_of(node: Any, v: fx.Node) -> Optional[list[fx.Node]]:
    """The nodes computing v**3, as `pow(v, 3)` or Inductor's `(v * v) * v`; None if `node` is neither."""
    if gu.is_call(node, aten.pow.Tensor_Scalar) and node.args[0] is v and _close(node.args[1], 3.0):
        return [node]
    ops = _mul_operands(node)
    if ops is None or v not in ops:
        return None
    square = ops[1] if ops[0] is v else ops[0]
    square_ops = _mul_operands(square)
    if square_ops is None or square_ops[0] is not v or square_ops[1] is not v:
        return None
    return [node, square]


def _match_decomposed_gelu_tanh(node: Any) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """0.5*v * (1 + tanh(sqrt(2/pi) * (v + 0.044715 * v**3))), as GPT-2's gelu_new traces. (v, nodes) or None."""
    ops = _mul_operands(node)
    if ops is None:
        return None
    for half, rest in (ops, ops[::-1]):
        half_ops = _mul_operands(half)
        if half_ops is None or not _close(half_ops[1], 0.5) or not isinstance(half_ops[0], fx.Node):
            continue
        v = half_ops[0]
        if not (gu.is_call(rest, aten.add.Tensor) and _close(rest.args[1], 1.0)):
            continue
        tanh = rest.args[0]
        if not gu.is_call(tanh, aten.tanh.default):
            continue
        scaled = _mul_operands(tanh.args[0])
        if scaled is None or not _close(scaled[1], _SQRT_2_OVER_PI):
            continue
        inner = scaled[0]
        if not (gu.is_call(inner, aten.add.Tensor) and inner.args[0] is v):
            continue
        cubic = _mul_operands(inner.args[1])
        if cubic is None or not _close(cubic[1], 0.044715):
            continue
        power = cubic[0]
        cube_nodes = _cube_of(power, v)
        if cube_nodes is None:
            continue
        return v, [node, half, rest, tanh, tanh.args[0], inner, inner.args[1], *cube_nodes]
    return None


def _match_decomposed_silu(node: Any) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """v / (1 + exp(-v)) or v * sigmoid(v): SiLU after Inductor's decompositions. (v, nodes) or None."""
    if gu.is_call(node, aten.mul.Tensor) and not node.kwargs:
        for v, sig in (node.args, node.args[::-1]):
            if gu.is_call(sig, aten.sigmoid.default) and sig.args[0] is v and isinstance(v, fx.Node):
                return v, [node, sig]
        return None
    if not (gu.is_call(node, aten.div.Tensor) and not node.kwargs and isinstance(node.args[0], fx.Node)):
        return None
    v, denominator = node.args
    if not gu.is_call(denominator, aten.add.Tensor):
        return None
    exp, one = denominator.args if gu.is_call(denominator.args[0], aten.exp.default) else denominator.args[::-1]
    if not (gu.is_call(exp, aten.exp.default) and _close(one, 1.0)):
        return None
    negated = exp.args[0]
    if not (gu.is_call(negated, aten.neg.default) and negated.args[0] is v):
        return None
    return v, [node, denominator, exp, negated]


def match_activation(node: Any) -> Optional[tuple[str, fx.Node, list[fx.Node]]]:
    """(act name, its input node, the nodes that compute it) if `node` is an activation ttftc ops know."""
    if gu.is_call(node, aten.silu.default):
        return "silu", node.args[0], [node]
    decomposed_silu = _match_decomposed_silu(node)
    if decomposed_silu is not None:
        return "silu", decomposed_silu[0], decomposed_silu[1]
    if gu.is_call(node, aten.relu.default):
        return "relu", node.args[0], [node]
    if gu.is_call(node, aten.gelu.default):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return ("gelu_tanh" if approximate == "tanh" else "gelu"), node.args[0], [node]
    decomposed = _match_decomposed_gelu_tanh(node)
    if decomposed is not None:
        return "gelu_tanh", decomposed[0], decomposed[1]
    return None


# -- constants --------------------------------------------------------------------------------------------

# Elementwise ops that may sit between a frozen weight and its use and are folded at compile time (Gemma's
# `1 + w.float()`).
_CONVERT_ELEMENT_TYPE = torch.ops.prims.convert_element_type.default
_FOLDABLE = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.mul.Tensor, aten._to_copy.default,
             _CONVERT_ELEMENT_TYPE, aten.view.default, aten.alias.default, aten.clone.default}


def cast_dtype(node: Any) -> Optional[torch.dtype]:
    """The dtype a dtype-only cast converts to, else None. Casts are `_to_copy` (`.to(dtype)`; `type_as` also
    spells out layout and device, which must stay what they were) or, in Inductor's graphs,
    `prims.convert_element_type`."""
    if gu.is_call(node, _CONVERT_ELEMENT_TYPE) and len(node.args) == 2 and not node.kwargs:
        return node.args[1]
    if not gu.is_call(node, aten._to_copy.default) or "dtype" not in node.kwargs or len(node.args) != 1:
        return None
    src = gu.val(node.args[0])
    if set(node.kwargs) - {"dtype", "layout", "device"}:
        return None
    if node.kwargs.get("layout") not in (None, torch.strided):
        return None
    device = node.kwargs.get("device")
    if device is not None and not (isinstance(src, torch.Tensor) and torch.device(device) == src.device):
        return None
    return node.kwargs["dtype"]


def is_dtype_cast(node: Any) -> bool:
    return cast_dtype(node) is not None


def fold_constant(gm: fx.GraphModule, node: Any, depth: int = 6) -> Optional[torch.Tensor]:
    """The value of a small subgraph over frozen constants and scalars, computed now; None if it is not one."""
    if not isinstance(node, fx.Node):
        return None
    constant = gu.constant_value(gm, node)
    if constant is not None:
        return constant
    if depth == 0 or not gu.is_call(node, *_FOLDABLE):
        return None
    if node.target in (aten._to_copy.default, _CONVERT_ELEMENT_TYPE):
        dtype = cast_dtype(node)
        if dtype is None:
            return None  # only dtype casts: a device or layout change is not a constant fold
        value = fold_constant(gm, node.args[0], depth - 1)
        return None if value is None else value.to(dtype)
    args = []
    for arg in node.args:
        if isinstance(arg, fx.Node):
            value = fold_constant(gm, arg, depth - 1)
            if value is None:
                return None
            args.append(value)
        elif isinstance(arg, (int, float, list, tuple)) and not isinstance(arg, bool):
            args.append(arg)
        else:
            return None
    return node.target(*args, **node.kwargs)


def constant_inputs_of(node: fx.Node) -> list[fx.Node]:
    """The get_attr leaves under a constant subgraph (they stay in the graph while other users read them)."""
    if node.op == "get_attr":
        return [node]
    leaves = []
    for arg in node.all_input_nodes:
        leaves.extend(constant_inputs_of(arg))
    return leaves
