"""The rope pass: Hugging Face's rotate-half rotary embedding, decomposed into six ATen steps, becomes ttftc.rope.

Pattern, per query or key tensor x (apply_rotary_pos_emb after functionalisation):

    add(mul(x, cos), mul(cat([neg(slice(x, -1, D/2, end)), slice(x, -1, 0, D/2)], -1), sin))

with either operand order of each mul and of the add. The guard proves, for every match:
- the two slices cut x's last dimension into exactly its two halves, and the cat joins them back along it;
- x, cos, sin and the result share a dtype and device, and cos and sin broadcast to x without growing it (the
  op's contract, ops/rope.py), so the result has x's shape;
- the op's output layout is the one the graph was traced with (the strides of every dimension longer than 1), so
  the views after it still hold;
- every intermediate (slices, neg, cat, both products) has no user outside the pattern, so nothing else reads
  a value the rewrite removes.
Anything else (interleaved RoPE, a partial rotation that rotates only a slice of D through a different route, a
mixed-dtype product) is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.fx as fx

from ttftc.ops.rope import rope_output_strides, rope_shape_reason
from ttftc import fx_utils as gu
from ttftc.passes.base import GraphPass

aten = torch.ops.aten


@dataclass
class RopeMatch:
    add: fx.Node  # the sum, replaced by ttftc.rope
    x_cos: fx.Node  # mul(x, cos)
    rotated_sin: fx.Node  # mul(cat(...), sin)
    x: Optional[fx.Node] = None
    cos: Optional[fx.Node] = None
    sin: Optional[fx.Node] = None


def _other(mul: fx.Node, operand: fx.Node) -> Optional[fx.Node]:
    """The operand of a binary mul that is not `operand` (None when it is not a node)."""
    a, b = mul.args[:2]
    other = b if a is operand else a if b is operand else None
    return other if isinstance(other, fx.Node) else None


def _slice_bounds(node: fx.Node, x: fx.Node) -> Optional[tuple[int, int, int]]:
    """(dim, start, end) of aten.slice.Tensor(x, dim, start, end, step=1) with static ints, else None."""
    if not gu.is_call(node, aten.slice.Tensor) or node.args[0] is not x:
        return None
    bound = gu.bound_arguments(node)
    if bound is None:
        return None
    dim, start, end, step = (gu.static_int(bound[name]) for name in ("dim", "start", "end", "step"))
    if None in (dim, start, end) or step != 1:
        return None
    return dim, start, end


def _last_dim(dim: int, rank: int) -> bool:
    return dim in (rank - 1, -1)


class RopePass(GraphPass):
    name = "rope"

    def find(self, gm: fx.GraphModule) -> Iterator[RopeMatch]:
        for node in gm.graph.nodes:
            if not gu.is_call(node, aten.add.Tensor) or node.kwargs or len(node.args) != 2:
                continue
            products = [a for a in node.args if gu.is_call(a, aten.mul.Tensor)]
            if len(products) != 2:
                continue
            rotated = [p for p in products if any(gu.is_call(a, aten.cat.default) for a in p.args[:2])]
            if len(rotated) == 1:
                plain = products[1] if rotated[0] is products[0] else products[0]
                yield RopeMatch(add=node, x_cos=plain, rotated_sin=rotated[0])

    def guard(self, gm: fx.GraphModule, match: RopeMatch) -> Optional[str]:
        cat = next(a for a in match.rotated_sin.args[:2] if gu.is_call(a, aten.cat.default))
        match.sin = _other(match.rotated_sin, cat)
        pieces, cat_dim = cat.args[0], (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0))
        if match.sin is None or len(pieces) != 2 or not gu.is_call(pieces[0], aten.neg.default):
            return f"{match.add.name}: not mul(cat([neg(..), ..]), sin)"
        neg, low = pieces
        high = neg.args[0]
        x = low.args[0] if gu.is_call(low, aten.slice.Tensor) else None
        if x is None or x not in match.x_cos.args[:2]:
            return f"{match.add.name}: the rotated halves are not slices of the tensor multiplied by cos"
        match.x, match.cos = x, _other(match.x_cos, x)
        if match.cos is None:
            return f"{match.add.name}: cos is not a tensor"
        x_val, cos_val, sin_val, out_val = (gu.val(n) for n in (x, match.cos, match.sin, match.add))
        if not all(isinstance(v, torch.Tensor) for v in (x_val, cos_val, sin_val, out_val)):
            return f"{match.add.name}: missing tensor metadata"
        rank, width = x_val.dim(), gu.static_int(x_val.shape[-1]) if x_val.dim() else None
        if width is None:
            return f"{match.add.name}: the head dimension is not static"
        half = width // 2
        low_bounds, high_bounds = _slice_bounds(low, x), _slice_bounds(high, x)
        if low_bounds is None or high_bounds is None:
            return f"{match.add.name}: the halves are not static unit-step slices of x"
        cat_dim = gu.static_int(cat_dim)
        if cat_dim is None or not all(_last_dim(d, rank) for d in (low_bounds[0], high_bounds[0], cat_dim)):
            return f"{match.add.name}: slices or cat are not along the last dimension"
        if width % 2 or low_bounds[1:] != (0, half) or high_bounds[1] != half or high_bounds[2] < width:
            return f"{match.add.name}: the slices are not the two halves of a head dimension of {width}"
        reason = rope_shape_reason(x_val, cos_val, sin_val)
        if reason is not None:
            return f"{match.add.name}: {reason}"
        if out_val.dtype != x_val.dtype or str(out_val.shape) != str(x_val.shape) or \
                len({v.device for v in (x_val, cos_val, sin_val)}) != 1:
            return f"{match.add.name}: the result's dtype, shape or device is not x's"
        fused_strides = rope_output_strides(x_val, cos_val)
        if any(str(a) != str(b) for size, a, b in zip(out_val.shape, fused_strides, out_val.stride()) if str(size) != "1"):
            return f"{match.add.name}: the traced layout {tuple(out_val.stride())} is not the op's {fused_strides}"
        for node in (match.x_cos, match.rotated_sin, cat, neg, low, high):
            if len(node.users) != 1:
                return f"{match.add.name}: {node.name} has users outside the pattern"
        return None

    def replace(self, gm: fx.GraphModule, match: RopeMatch) -> None:
        with gm.graph.inserting_before(match.add):
            fused = gu.call(gm, torch.ops.ttftc.rope.default, (match.x, match.cos, match.sin))
        match.add.replace_all_uses_with(fused)
        gm.graph.erase_node(match.add)
