"""The norm_linear pass: RMSNorm / LayerNorm (and the residual add before it) fused with the linears it feeds.

RMSNorm is matched in the form Hugging Face traces (to fp32, pow 2, mean over the last dimension, add eps, rsqrt,
multiply, back to the input dtype, multiply by the weight); a weight expression over frozen constants (Gemma's
`1 + w`) is folded at compile time. LayerNorm is `aten.native_layer_norm` over the last dimension.

What the norm feeds decides the replacement:
- only linears with frozen weights (q, k, v; or one lm_head): one `ttftc.norm_linear` with their weights
  concatenated into one GEMM; each linear's output becomes a column slice (a view) of the merged output.
- anything else (a `gated_ffn`, a slice before the lm_head, a graph output): `ttftc.norm`, the norm alone.
A residual add right before the norm is fused either way; the op returns the new residual stream.

The guard proves eps is a constant, the weights are frozen and shaped [H], no intermediate of the norm is read
elsewhere, and that the views downstream of each column slice accept its strides.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx

from ttftc.passes import _linear
from ttftc import fx_utils as gu
from ttftc.passes._linear import (
    LinearMatch,
    copy_provenance,
    fold_constant,
    match_linear,
    reshape_shape,
    row_view_users,
    up_row_views,
)
from ttftc.passes.base import GraphPass

aten = torch.ops.aten

# Ops downstream of a q/k/v output that only re-describe memory: they must accept a column slice's strides.
_STRIDED_VIEW_OPS = gu.VIEW_OPS | {
    aten.transpose.int, aten.permute.default, aten.t.default, aten.slice.Tensor, aten.select.int,
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.alias.default, aten.as_strided.default,
    operator.getitem,
}


@dataclass
class NormMatch:
    anchor: fx.Node  # rsqrt (RMSNorm) or native_layer_norm
    kind: str = ""
    x: Optional[fx.Node] = None  # the norm's input
    y: Optional[fx.Node] = None  # the node producing the scaled, normalised tensor
    norm_w: Optional[torch.Tensor] = None
    norm_w_node: Optional[fx.Node] = None  # the get_attr holding norm_w as is, when there is one
    norm_b_node: Optional[fx.Node] = None
    eps: float = 0.0
    internal: set = field(default_factory=set)  # pattern nodes other than x
    residual_add: Optional[fx.Node] = None
    linears: list = field(default_factory=list)


def _is_cast(node: Any, dtype: Optional[torch.dtype] = None) -> bool:
    """A dtype-only cast (see _linear.cast_dtype), to `dtype` if given."""
    cast_to = _linear.cast_dtype(node)
    return cast_to is not None and (dtype is None or cast_to == dtype)


def _other_operand(mul: fx.Node, known: fx.Node) -> Any:
    if not gu.is_call(mul, aten.mul.Tensor) or mul.kwargs:
        return None
    a, b = mul.args
    return b if a is known else a if b is known else None


def _other_operand_of_add(add: Any, known: fx.Node) -> Any:
    if not gu.is_call(add, aten.add.Tensor) or add.kwargs:
        return None
    a, b = add.args
    return b if a is known else a if b is known else None


def _variance_of(rsqrt: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """(var, var_mean) when rsqrt reads var + eps with var = var_mean(...)[0]; None otherwise."""
    add_eps = rsqrt.args[0]
    if not gu.is_call(add_eps, aten.add.Tensor, aten.add.Scalar) or add_eps.kwargs:
        return None
    for var in add_eps.args:
        if gu.is_call(var, operator.getitem) and var.args[1] == 0 and gu.is_call(var.args[0], aten.var_mean.correction):
            return var, var.args[0]
    return None


class NormLinearPass(GraphPass):
    name = "norm_linear"

    def find(self, gm: fx.GraphModule) -> Iterable[NormMatch]:
        for node in gm.graph.nodes:
            if gu.is_call(node, aten.rsqrt.default, aten.native_layer_norm.default):
                yield NormMatch(node)

    # -- guard --------------------------------------------------------------------------------------------
    def guard(self, gm: fx.GraphModule, m: NormMatch) -> Optional[str]:
        if gu.is_call(m.anchor, aten.rsqrt.default) and _variance_of(m.anchor) is not None:
            reason = self._parse_decomposed_layer(gm, m)
        elif gu.is_call(m.anchor, aten.rsqrt.default):
            reason = self._parse_rms(gm, m)
        else:
            reason = self._parse_layer(gm, m)
        if reason is not None:
            return reason
        x_val, y_val = gu.val(m.x), gu.val(m.y)
        hidden = x_val.shape[-1]
        if gu.static_int(hidden) is None:
            return f"{m.kind} norm: hidden size is symbolic"
        if m.norm_w.dim() != 1 or m.norm_w.shape[0] != hidden:
            return f"{m.kind} norm: weight shape {tuple(m.norm_w.shape)} is not [{hidden}]"
        if str(y_val.shape) != str(x_val.shape):
            return f"{m.kind} norm: output shape {tuple(y_val.shape)} differs from input {tuple(x_val.shape)}"
        if y_val.dtype != torch.promote_types(x_val.dtype, m.norm_w.dtype):
            return f"{m.kind} norm: output dtype {y_val.dtype} is not what the op computes"
        for n in m.internal - {m.y}:
            for user in n.users:
                if user not in m.internal:
                    return f"{m.kind} norm: intermediate {n.name} is read by {user.name} outside the norm"
        self._find_residual(m)
        return self._find_linears(gm, m)

    def _parse_rms(self, gm: fx.GraphModule, m: NormMatch) -> Optional[str]:
        m.kind = "rms"
        rsqrt = m.anchor
        add_eps = rsqrt.args[0]
        if not gu.is_call(add_eps, aten.add.Tensor, aten.add.Scalar) or add_eps.kwargs:
            return "rms norm: rsqrt input is not mean + eps"
        mean, eps = add_eps.args
        if not isinstance(mean, fx.Node):
            mean, eps = eps, mean
        eps = gu.scalar(eps)
        if eps is None:
            return "rms norm: eps is not a constant"
        m.eps = eps
        if not gu.is_call(mean, aten.mean.dim) or mean.kwargs.get("dtype") is not None:
            return "rms norm: rsqrt input is not a mean"
        square = mean.args[0]
        dims = list(mean.args[1]) if len(mean.args) > 1 else []
        keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        if gu.is_call(square, aten.pow.Tensor_Scalar) and gu.scalar(square.args[1]) == 2.0:
            xf = square.args[0]
        elif gu.is_call(square, aten.mul.Tensor) and square.args[0] is square.args[1]:
            xf = square.args[0]
        else:
            return "rms norm: mean is not over x squared"
        if not isinstance(xf, fx.Node) or not isinstance(gu.val(xf), torch.Tensor):
            return "rms norm: squared operand is not a tensor"
        rank = gu.val(xf).dim()
        if not keepdim or len(dims) != 1 or dims[0] not in (-1, rank - 1):
            return "rms norm: mean is not over the last dimension with keepdim"
        if _is_cast(xf, torch.float32):
            m.x = xf.args[0]
            cast_in = {xf}
        elif gu.val(xf).dtype == torch.float32:
            m.x, cast_in = xf, set()
        else:
            return f"rms norm: statistics computed in {gu.val(xf).dtype}, not fp32"
        x_dtype = gu.val(m.x).dtype
        normed = gu.only_user(rsqrt)
        if normed is None or _other_operand(normed, rsqrt) is not xf:
            return "rms norm: rsqrt is not multiplied into x (or is read elsewhere)"
        after = gu.only_user(normed)
        if after is None:
            return "rms norm: normalised tensor has several users before the weight"
        internal = cast_in | {square, mean, add_eps, rsqrt, normed}
        if _is_cast(after, x_dtype) and x_dtype != torch.float32:
            weight_mul = gu.only_user(after)
            internal.add(after)
            w_expr = _other_operand(weight_mul, after) if weight_mul is not None else None
        else:
            weight_mul = after
            w_expr = _other_operand(after, normed)
            final = gu.only_user(after) if w_expr is not None else None
            if x_dtype != torch.float32 and final is not None and _is_cast(final, x_dtype):
                return ("rms norm: weight applied in fp32 before the cast back (Gemma style) on "
                        f"{x_dtype} input; the op applies it after the cast")
            if x_dtype != torch.float32:
                return f"rms norm: {x_dtype} input is not cast back to {x_dtype} before the weight"
        if w_expr is None:
            return "rms norm: no weight multiply after the normalisation"
        weight = fold_constant(gm, w_expr)
        if weight is None:
            return "rms norm: weight is not a frozen constant"
        m.norm_w = weight.reshape(-1) if weight.dim() > 1 and weight.numel() == weight.shape[-1] else weight
        m.norm_w_node = w_expr if w_expr.op == "get_attr" and weight.dim() == 1 else None
        internal |= gu.nodes_between([w_expr], [n for n in gm.graph.nodes if n.op == "get_attr"])
        m.y = weight_mul
        internal.add(weight_mul)
        m.internal = internal
        return None

    def _parse_layer(self, gm: fx.GraphModule, m: NormMatch) -> Optional[str]:
        m.kind = "layer"
        ln = m.anchor
        args = list(ln.args) + [None] * (5 - len(ln.args))
        x, shape, w, b, eps = args[:5]
        m.x = x
        x_val = gu.val(x)
        if not isinstance(x_val, torch.Tensor) or list(shape) != [x_val.shape[-1]]:
            return "layer norm: not over exactly the last dimension"
        m.eps = gu.scalar(eps)
        if m.eps is None:
            return "layer norm: eps is not a constant"
        weight = gu.constant_value(gm, w) if w is not None else torch.ones(int(x_val.shape[-1]), dtype=x_val.dtype)
        if weight is None:
            return "layer norm: weight is not a frozen constant"
        if b is not None and gu.constant_value(gm, b) is None:
            return "layer norm: bias is not a frozen constant"
        m.norm_w, m.norm_w_node, m.norm_b_node = weight, (w if w is not None else None), b
        users = list(ln.users)
        if not all(gu.is_call(u, operator.getitem) for u in users) or any(u.args[1] != 0 for u in users):
            return "layer norm: mean or rstd is read elsewhere"
        if len(users) != 1:
            return "layer norm: output is read through several getitems"
        m.y = users[0]
        m.internal = {ln, m.y}
        return None

    def _parse_decomposed_layer(self, gm: fx.GraphModule, m: NormMatch) -> Optional[str]:
        """LayerNorm as Inductor's decompositions spell it: var_mean, (x - mean) * rsqrt(var + eps) * w + b."""
        m.kind = "layer"
        rsqrt = m.anchor
        add_eps = rsqrt.args[0]
        var, var_mean = _variance_of(rsqrt)
        m.eps = gu.scalar(add_eps.args[1] if add_eps.args[0] is var else add_eps.args[0])
        if m.eps is None:
            return "layer norm: eps is not a constant"
        x = var_mean.args[0]
        x_val = gu.val(x)
        if not isinstance(x_val, torch.Tensor) or x_val.dtype != torch.float32:
            return "layer norm: decomposed form on a non-fp32 input"
        dims = list(var_mean.args[1]) if len(var_mean.args) > 1 else []
        if (var_mean.kwargs.get("correction") != 0 or not var_mean.kwargs.get("keepdim")
                or dims not in ([-1], [x_val.dim() - 1])):
            return "layer norm: var_mean is not the biased variance over the last dimension"
        items = {int(u.args[1]): u for u in var_mean.users if gu.is_call(u, operator.getitem)}
        if len(items) != 2 or len(var_mean.users) != 2 or items[0] is not var:
            return "layer norm: var_mean's results are read elsewhere"
        centred = gu.only_user(items[1])
        if not (gu.is_call(centred, aten.sub.Tensor) and centred.args == (x, items[1])):
            return "layer norm: the mean is not subtracted from x"
        normed = gu.only_user(rsqrt)
        if normed is None or _other_operand(normed, rsqrt) is not centred or len(centred.users) != 1:
            return "layer norm: rsqrt is not multiplied into x - mean (or is read elsewhere)"
        weight_mul = gu.only_user(normed)
        w_node = _other_operand(weight_mul, normed) if weight_mul is not None else None
        weight = gu.constant_value(gm, w_node)
        if weight is None:
            return "layer norm: weight is not a frozen constant"
        m.x, m.norm_w, m.norm_w_node = x, weight, w_node
        m.internal = {var_mean, var, items[1], add_eps, rsqrt, centred, normed, weight_mul}
        m.y = weight_mul
        bias_add = gu.only_user(weight_mul)
        b_node = _other_operand_of_add(bias_add, weight_mul)
        if b_node is not None and gu.constant_value(gm, b_node) is not None:
            m.norm_b_node, m.y = b_node, bias_add
            m.internal.add(bias_add)
        return None

    def _find_residual(self, m: NormMatch) -> None:
        add = m.x
        if not gu.is_call(add, aten.add.Tensor) or add.kwargs or len(add.args) != 2:
            return
        a, b = add.args
        if not all(isinstance(t, fx.Node) and gu.tensor_meta_matches(gu.val(t), gu.val(add)) for t in (a, b)):
            return
        # residual_out appears where the op is inserted (before the first pattern node); a reader of the sum
        # that comes earlier could not see it, so such an add stays unfused.
        order = {n: i for i, n in enumerate(add.graph.nodes)}
        start = min(order[n] for n in m.internal)
        if any(order[u] < start for u in add.users if u not in m.internal):
            return
        m.residual_add = add

    def _find_linears(self, gm: fx.GraphModule, m: NormMatch) -> Optional[str]:
        users = row_view_users(m.y)
        if not users:
            return None  # standalone norm
        linears = [match_linear(gm, u) for u in users]
        if any(lin is None for lin in linears) or len({u for u in users}) != len(users):
            return None
        y_val = gu.val(m.y)
        for lin in linears:
            if up_row_views(lin.x)[0] is not m.y:
                return None  # the norm feeds a linear's weight or bias, not its activations
            if lin.weight.shape[1] != y_val.shape[-1] or lin.weight.dtype != y_val.dtype:
                return None
            if lin.bias is not None and lin.bias.dtype != y_val.dtype:
                return None
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        linears.sort(key=lambda lin: order[lin.node])
        first = linears[0]
        if first.x is not m.y and reshape_shape(first.x) is None:
            return None
        if len(linears) > 1:
            reason = self._slices_fit_downstream_views(gm, linears)
            if reason is not None:
                return reason
        m.linears = linears
        return None

    def _slices_fit_downstream_views(self, gm: fx.GraphModule, linears: list[LinearMatch]) -> Optional[str]:
        """Replay the view ops after each linear on a column slice of the merged output (fake tensors)."""
        total = sum(lin.out_features for lin in linears)
        fake_mode = gu.fake_mode_of(gm)
        offset = 0
        with fake_mode:
            for lin in linears:
                out_val = gu.val(lin.node)
                merged = out_val.new_empty((out_val.shape[0], total))
                piece = merged[:, offset:offset + lin.out_features]
                offset += lin.out_features
                failed = _replay_views(lin.node, piece)
                if failed is not None:
                    return (f"merged linears: {failed.name} after {lin.node.name} needs a contiguous tensor, "
                            "a column slice of the merged GEMM is not")
        return None

    # -- replace ------------------------------------------------------------------------------------------
    def replace(self, gm: fx.GraphModule, m: NormMatch) -> None:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        start = min(m.internal, key=lambda n: order[n])
        if m.residual_add is not None:
            x_arg, residual_arg = m.residual_add.args
        else:
            x_arg, residual_arg = m.x, None
        with gm.graph.inserting_before(start):
            norm_w = m.norm_w_node or gu.add_constant(gm, f"{m.anchor.name}_norm_w", m.norm_w.contiguous())
            if m.linears:
                weight, bias = self._merged_weights(gm, m.linears)
                op = gu.call(gm, torch.ops.ttftc.norm_linear.default,
                             (x_arg, norm_w, m.norm_b_node, weight, bias, residual_arg),
                             {"kind": m.kind, "eps": m.eps})
            else:
                op = gu.call(gm, torch.ops.ttftc.norm.default, (x_arg, norm_w, m.norm_b_node, residual_arg),
                             {"kind": m.kind, "eps": m.eps})
            copy_provenance(op, m.linears[0].node if m.linears else m.anchor)
            first_out = gu.call(gm, operator.getitem, (op, 0))
            residual_out = gu.call(gm, operator.getitem, (op, 1))
        if m.residual_add is not None:
            if not gu.tensor_meta_matches(residual_out.meta["val"], m.residual_add.meta["val"]):
                raise RuntimeError(f"norm replacement changed the residual {m.residual_add.name}")
            m.residual_add.replace_all_uses_with(residual_out, delete_user_cb=lambda u: u not in m.internal)
        if m.linears:
            self._split_outputs(gm, m, first_out)
        else:
            if not gu.tensor_meta_matches(first_out.meta["val"], m.y.meta["val"]):
                raise RuntimeError(f"norm replacement changed {m.y.name}'s shape or dtype")
            m.y.replace_all_uses_with(first_out)

    def _merged_weights(self, gm: fx.GraphModule, linears: list[LinearMatch]) -> tuple[fx.Node, Optional[fx.Node]]:
        name = linears[0].node.name
        if len(linears) == 1 and linears[0].weight_node is not None:
            return linears[0].weight_node, linears[0].bias_node
        weight = torch.cat([lin.weight for lin in linears]).contiguous()
        biases = [lin.bias for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else weight.new_zeros(lin.out_features)
                              for b, lin in zip(biases, linears)])
        weight_node = gu.add_constant(gm, f"{name}_merged_w", weight)
        bias_node = gu.add_constant(gm, f"{name}_merged_b", bias) if bias is not None else None
        return weight_node, bias_node

    def _split_outputs(self, gm: fx.GraphModule, m: NormMatch, out: fx.Node) -> None:
        first = m.linears[0]
        total = sum(lin.out_features for lin in m.linears)
        anchor = first.x if first.x is not m.y else first.node
        with gm.graph.inserting_before(anchor):
            if first.x is m.y:
                out2d = out
            else:
                shape = reshape_shape(first.x)
                shape[-1] = total
                out2d = gu.call(gm, aten.view.default, (out, shape))
            offset = 0
            for lin in m.linears:
                n = lin.out_features
                piece = out2d if len(m.linears) == 1 else gu.call(
                    gm, aten.slice.Tensor, (out2d, 1, offset, offset + n))
                offset += n
                if not gu.tensor_meta_matches(piece.meta["val"], lin.node.meta["val"]):
                    raise RuntimeError(f"norm_linear replacement changed {lin.node.name}'s shape or dtype")
                lin.node.replace_all_uses_with(piece)


def _replay_views(node: fx.Node, value: Any) -> Optional[fx.Node]:
    """Re-run the view-like users of `node` (recursively) with `value` in its place; the first that fails."""
    for user in node.users:
        if not gu.is_call(user, *_STRIDED_VIEW_OPS):
            continue  # computing ops read any strides
        args = [_meta_with(a, node, value) for a in user.args]
        kwargs = {k: _meta_with(v, node, value) for k, v in user.kwargs.items()}
        try:
            result = user.target(*args, **kwargs)
        except Exception:
            return user
        failed = _replay_views(user, result)
        if failed is not None:
            return failed
    return None


def _meta_with(arg: Any, node: fx.Node, value: Any) -> Any:
    if arg is node:
        return value
    if isinstance(arg, fx.Node):
        return gu.val(arg)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_meta_with(a, node, value) for a in arg)
    return arg
