"""The ffn pass: feed-forward blocks become ttftc.gated_ffn or ttftc.linear_act.

Gated MLPs, `down(act(gate(x)) * up(x))` (SwiGLU in Llama/Qwen2/Mistral, GeGLU with gelu-tanh in Gemma), become
one `gated_ffn` whose gate|up weight is `[W_gate; W_up]`, concatenated once here at compile time. A model whose
gate and up are already merged (Phi-3's `gate_up_proj` followed by `chunk(2, -1)`) is recognised too: its
weight is reordered into gate-then-up if needed.

Non-gated MLPs (GPT-2's `addmm → gelu(tanh) → addmm`) fuse bias and activation into the first GEMM as
`linear_act`; the second GEMM stays as it is.

The guard proves: frozen weights with matching shapes and dtypes, gate and up read the same activations through
row-preserving views only, the multiply does not broadcast, and no intermediate tensor is read elsewhere.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterable, Optional, Union

import torch
import torch.fx as fx

from ttftc import fx_utils as gu
from ttftc.passes._linear import (
    LinearMatch,
    copy_provenance,
    match_activation,
    match_linear,
    row_view_users,
    tensor_region,
    up_row_views,
)
from ttftc.passes.base import GraphPass

aten = torch.ops.aten


@dataclass
class GatedMatch:
    down: LinearMatch
    act: str = ""
    x: Optional[fx.Node] = None  # the 2-D activations gate and up both read
    w_gate_up: Optional[torch.Tensor] = None
    b_gate_up: Optional[torch.Tensor] = None
    region: set = field(default_factory=set)


@dataclass
class LinearActMatch:
    act_out: fx.Node  # the activation's output node, replaced by linear_act
    linear: Optional[LinearMatch] = None
    act: str = ""
    x: Optional[fx.Node] = None


Match = Union[GatedMatch, LinearActMatch]


def _same_shape(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and str(a.shape) == str(b.shape)


def _leading_shape_matches(a: fx.Node, b: fx.Node) -> bool:
    va, vb = gu.val(a), gu.val(b)
    return va.dim() == vb.dim() and all(str(x) == str(y) for x, y in zip(va.shape[:-1], vb.shape[:-1]))


def _stack_bias(linears: list[LinearMatch], weight: torch.Tensor) -> Optional[torch.Tensor]:
    """Concatenated biases, zeros for a linear without one; None when none has a bias."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([
        lin.bias if lin.bias is not None else weight.new_zeros(lin.out_features) for lin in linears
    ])


def _looks_gated(node) -> bool:
    """A multiply with an activation on one side: the anchor shape of act(gate) * up."""
    if not gu.is_call(node, aten.mul.Tensor):
        return False
    return any(isinstance(a, fx.Node) and match_activation(up_row_views(a)[0]) is not None for a in node.args)


class FfnPass(GraphPass):
    name = "ffn"

    # -- find ---------------------------------------------------------------------------------------------
    def find(self, gm: fx.GraphModule) -> Iterable[Match]:
        for node in gm.graph.nodes:
            down = match_linear(gm, node)
            if down is not None and _looks_gated(up_row_views(down.x)[0]):
                yield GatedMatch(down)
        for node in gm.graph.nodes:
            # An activation whose output only feeds linears: the non-gated MLP's first GEMM.
            if match_activation(node) is not None:
                users = row_view_users(node)
                if users and all(match_linear(gm, u) is not None for u in users):
                    yield LinearActMatch(node)

    # -- guard --------------------------------------------------------------------------------------------
    def guard(self, gm: fx.GraphModule, match: Match) -> Optional[str]:
        if isinstance(match, GatedMatch):
            return self._guard_gated(gm, match)
        return self._guard_linear_act(gm, match)

    def _guard_gated(self, gm: fx.GraphModule, m: GatedMatch) -> Optional[str]:
        down = match_linear(gm, m.down.node)  # re-read: an earlier replacement may have changed the graph
        if down is None:
            return "gated ffn: down projection is no longer a linear with frozen weights"
        m.down = down
        mul = up_row_views(down.x)[0]
        a, b = mul.args[0], mul.args[1]
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or mul.kwargs:
            return "gated ffn: the gate*up multiply has a scalar or extra argument"
        if not (_same_shape(gu.val(a), gu.val(b)) and _same_shape(gu.val(a), gu.val(mul))):
            return "gated ffn: the gate*up multiply broadcasts"
        gate_side = up_row_views(a)[0], up_row_views(b)[0]
        act_first = match_activation(gate_side[0])
        act_second = match_activation(gate_side[1])
        if act_first is not None:
            act_info, up_src = act_first, gate_side[1]
        elif act_second is not None:
            act_info, up_src = act_second, gate_side[0]
        else:
            return "gated ffn: neither multiply operand is a known activation (silu, gelu, gelu-tanh, relu)"
        m.act, gate_in, _ = act_info
        gate_src = up_row_views(gate_in)[0]

        reason = self._gate_up_weights(gm, m, gate_src, up_src)
        if reason is not None:
            return reason

        if down.weight.shape[1] * 2 != m.w_gate_up.shape[0]:
            return (f"gated ffn: down projection takes {down.weight.shape[1]} features but gate|up gives "
                    f"{m.w_gate_up.shape[0] // 2}")
        dtype = gu.val(m.x).dtype
        for name, t in (("gate|up weight", m.w_gate_up), ("down weight", down.weight)):
            if t.dtype != dtype:
                return f"gated ffn: {name} dtype {t.dtype} differs from activation dtype {dtype}"
        if gu.val(m.x).shape[-1] != m.w_gate_up.shape[1]:
            return "gated ffn: gate|up weight does not match the activation width"
        if not _leading_shape_matches(m.x, down.node):
            return "gated ffn: views between the input and the down projection change the token dimension"

        region = tensor_region([down.node], [up_row_views(m.x)[0]])
        outside = gu.has_outside_users(region, keep=[down.node])
        if outside is not None:
            return f"gated ffn: intermediate {outside.name} is read outside the MLP"
        if any(n.op in ("placeholder", "output") for n in region):
            return "gated ffn: the MLP region reaches a graph input"
        m.region = region
        return None

    def _gate_up_weights(self, gm, m: GatedMatch, gate_src, up_src) -> Optional[str]:
        gate_lin, up_lin = match_linear(gm, gate_src), match_linear(gm, up_src)
        if gate_lin is not None and up_lin is not None:
            gx, ux = up_row_views(gate_lin.x)[0], up_row_views(up_lin.x)[0]
            if gx is not ux or str(gu.val(gate_lin.x).shape) != str(gu.val(up_lin.x).shape):
                return "gated ffn: gate and up projections read different activations"
            if gate_lin.weight.shape != up_lin.weight.shape:
                return f"gated ffn: gate {tuple(gate_lin.weight.shape)} and up {tuple(up_lin.weight.shape)} differ"
            m.x = gate_lin.x
            m.w_gate_up = torch.cat([gate_lin.weight, up_lin.weight]).contiguous()
            m.b_gate_up = _stack_bias([gate_lin, up_lin], m.w_gate_up)
            return None
        return self._merged_gate_up(gm, m, gate_src, up_src)

    def _merged_gate_up(self, gm, m: GatedMatch, gate_src, up_src) -> Optional[str]:
        """Phi-3: one linear, split in two halves along the last dimension."""
        halves = []
        for src in (gate_src, up_src):
            if not (gu.is_call(src, operator.getitem) and gu.is_call(src.args[0], aten.split.Tensor)):
                return "gated ffn: gate and up are neither two linears nor two halves of one merged linear"
            halves.append((src.args[0], src.args[1]))
        (split_g, index_g), (split_u, index_u) = halves
        if split_g is not split_u or {index_g, index_u} != {0, 1}:
            return "gated ffn: gate and up are not the two halves of one split"
        split = split_g
        merged_out, _ = up_row_views(split.args[0])
        merged = match_linear(gm, merged_out)
        if merged is None:
            return "gated ffn: the split gate|up tensor is not a linear with frozen weights"
        size = split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        split_in = gu.val(split.args[0])
        if dim not in (-1, split_in.dim() - 1) or size * 2 != merged.out_features:
            return "gated ffn: the merged gate|up is not split into two equal halves of the last dimension"
        weight, half = merged.weight, size
        parts = (weight[:half], weight[half:]) if index_g == 0 else (weight[half:], weight[:half])
        m.x = merged.x
        m.w_gate_up = torch.cat(parts).contiguous()
        if merged.bias is not None:
            b = merged.bias
            m.b_gate_up = (torch.cat([b[:half], b[half:]]) if index_g == 0 else torch.cat([b[half:], b[:half]]))
        return None

    def _guard_linear_act(self, gm: fx.GraphModule, m: LinearActMatch) -> Optional[str]:
        info = match_activation(m.act_out)
        if info is None:
            return "linear+act: activation no longer present"
        m.act, act_in, _ = info
        src, _ = up_row_views(act_in)
        linear = match_linear(gm, src)
        if linear is None:
            return "linear+act: the activation's input is not a linear with frozen weights"
        m.linear = linear
        x_src, _ = up_row_views(linear.x)
        x_val, out_val = gu.val(x_src), gu.val(m.act_out)
        if linear.weight.dtype != x_val.dtype or (linear.bias is not None and linear.bias.dtype != x_val.dtype):
            return f"linear+act: weight dtype {linear.weight.dtype} differs from activation dtype {x_val.dtype}"
        if not _leading_shape_matches(x_src, m.act_out) or out_val.dtype != x_val.dtype:
            return "linear+act: views between the input and the activation change the token dimension"
        m.x = x_src
        region = tensor_region([m.act_out], [x_src])
        outside = gu.has_outside_users(region, keep=[m.act_out])
        if outside is not None:
            return f"linear+act: intermediate {outside.name} is read outside the pattern"
        if any(n.op in ("placeholder", "output") for n in region):
            return "linear+act: the pattern reaches a graph input"
        return None

    # -- replace ------------------------------------------------------------------------------------------
    def replace(self, gm: fx.GraphModule, match: Match) -> None:
        if isinstance(match, GatedMatch):
            self._replace_gated(gm, match)
        else:
            self._replace_linear_act(gm, match)

    def _replace_gated(self, gm: fx.GraphModule, m: GatedMatch) -> None:
        down = m.down
        with gm.graph.inserting_before(down.node):
            w_gate_up = gu.add_constant(gm, f"{down.node.name}_w_gate_up", m.w_gate_up)
            b_gate_up = None
            if m.b_gate_up is not None:
                b_gate_up = gu.add_constant(gm, f"{down.node.name}_b_gate_up", m.b_gate_up)
            w_down = down.weight_node or gu.add_constant(gm, f"{down.node.name}_w_down", down.weight.contiguous())
            new = gu.call(gm, torch.ops.ttftc.gated_ffn.default, (m.x, w_gate_up, w_down, b_gate_up, down.bias_node),
                          {"act": m.act})
        if not gu.tensor_meta_matches(new.meta["val"], down.node.meta["val"]):
            raise RuntimeError(f"gated_ffn replacement changed {down.node.name}'s shape or dtype")
        copy_provenance(new, down.node)
        down.node.replace_all_uses_with(new)

    def _replace_linear_act(self, gm: fx.GraphModule, m: LinearActMatch) -> None:
        linear = m.linear
        with gm.graph.inserting_before(m.act_out):
            w = linear.weight_node or gu.add_constant(gm, f"{linear.node.name}_w", linear.weight.contiguous())
            new = gu.call(gm, torch.ops.ttftc.linear_act.default, (m.x, w, linear.bias_node), {"act": m.act})
        if not gu.tensor_meta_matches(new.meta["val"], m.act_out.meta["val"]):
            raise RuntimeError(f"linear_act replacement changed {m.act_out.name}'s shape or dtype")
        copy_provenance(new, linear.node)
        m.act_out.replace_all_uses_with(new)
