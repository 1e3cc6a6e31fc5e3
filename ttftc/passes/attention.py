"""The attention pass: softmax attention in the forms models emit → ttftc.attention.

Recognised forms (print a zoo model's aten graph to see them):
- "eager" attention: bmm(q, kᵀ) → scale (mul/div by constants) → mask (add of an additive mask, where, or
  masked_fill) → softmax (optionally between fp32 casts) → dropout that is a no-op in eval (a clone) → bmm(·, v),
  with the [B, H, ...] ↔ [B*H, ...] views matmul inserts; GQA through repeat_kv (unsqueeze → expand → clone →
  reshape) or through head broadcasting. The op receives the un-repeated K and V.
- SDPA: aten._scaled_dot_product_flash_attention_for_cpu, _scaled_dot_product_flash_attention,
  _scaled_dot_product_efficient_attention, _scaled_dot_product_attention_math and scaled_dot_product_attention,
  with is_causal or an attention mask.

The guard proves every parameter from the graph: the scale from constant multipliers, causality, q_offset and the
sliding window from the mask subgraph (ttftc.passes._attention_mask evaluates it symbolically, for every
sequence length), the head mapping from the view shapes, and that no intermediate (scores, probabilities, LSE) has
a user outside the match. Whatever it cannot prove stays unfused, with the reason in explain.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx

from ttftc.ops.attention import attention as attention_op
from ttftc import fx_utils as gu
from ttftc.passes._attention_mask import (
    MaskEvaluator,
    MaskSpec,
    Unprovable,
    hides,
    prove_mask,
    same_size,
    size_expr,
)
from ttftc.passes.base import GraphPass

aten = torch.ops.aten
prims = torch.ops.prims

_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_PASS_THROUGH = (aten.clone.default, aten.alias.default, aten.contiguous.default)
_CASTS = (aten._to_copy.default, prims.convert_element_type.default)
_SOFTMAX = (aten._softmax.default, aten._safe_softmax.default)

# SDPA overloads. Tuple outputs other than [0] (logsumexp, weights, RNG state) must be unused.
_SDPA_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_attention_math.default,
    aten.scaled_dot_product_attention.default,
}


class Reject(Exception):
    """Raised inside the matcher; the message is the rejection reason."""


@dataclass
class AttentionMatch:
    anchor: fx.Node  # the bmm(probabilities, v) or the SDPA node
    kind: str  # "eager" | "sdpa"
    plan: Optional["AttentionPlan"] = None


@dataclass
class AttentionPlan:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    outputs: list[fx.Node]  # nodes whose uses the ttftc.attention node takes over
    spec: MaskSpec
    scale: float
    region: list[fx.Node] = field(default_factory=list)  # intermediates that must have no outside users


# -- small structural helpers --------------------------------------------------------------------------------------


def _shape(node: Any) -> tuple:
    v = gu.val(node)
    if not isinstance(v, torch.Tensor):
        raise Reject(f"{getattr(node, 'name', node)} has no tensor metadata")
    return tuple(v.shape)


def _same_shape(a: Iterable, b: Iterable) -> bool:
    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def _single_user(node: fx.Node, what: str) -> None:
    if len(node.users) != 1:
        raise Reject(f"{what} ({node.name}) has other users")


def _norm_dim(d: int, rank: int) -> int:
    return d % rank


def _scalar_constant(gm: fx.GraphModule, x: Any) -> Optional[float]:
    """A Python number, or a 0-d/one-element frozen constant or scalar_tensor/full; None otherwise."""
    number = gu.scalar(x)
    if number is not None:
        return number
    if not isinstance(x, fx.Node):
        return None
    if x.op == "get_attr":
        t = gu.constant_value(gm, x)
        return float(t.item()) if t is not None and t.numel() == 1 else None
    if gu.is_call(x, aten.scalar_tensor.default):
        return gu.scalar(x.args[0])
    if gu.is_call(x, aten.full.default) and all(gu.static_int(s) == 1 for s in x.args[0]):
        return gu.scalar(x.args[1])
    if gu.is_call(x, aten.lift_fresh_copy.default, *_CASTS, *_PASS_THROUGH):
        return _scalar_constant(gm, x.args[0])
    return None


def _merged_heads(node3: fx.Node) -> tuple[fx.Node, tuple, list[fx.Node]]:
    """A bmm operand [B*H, X, Y] = reshape(expand?(M)) with M [B or 1, H or 1, X, Y]: (M, [B, H, X, Y], views)."""
    views = [node3]
    if not gu.is_call(node3, *_RESHAPES):
        raise Reject(f"bmm operand {node3.name} is not a reshape of a 4-D tensor")
    src = node3.args[0]
    shape3, shape4 = _shape(node3), _shape(src)
    if len(shape3) != 3 or len(shape4) != 4:
        raise Reject(f"bmm operand {node3.name} is not a [B*H, ., .] view of a [B, H, ., .] tensor")
    if not (same_size(size_expr(shape4[0]) * size_expr(shape4[1]), shape3[0]) and _same_shape(shape4[2:], shape3[1:])):
        raise Reject(f"bmm operand {node3.name} does not merge the batch and head dimensions")
    full = shape4
    while gu.is_call(src, *_PASS_THROUGH):
        views.append(src)
        src = src.args[0]
    if gu.is_call(src, aten.expand.default):
        views.append(src)
        src = src.args[0]
        inner = _shape(src)
        if len(inner) != 4 or not _same_shape(inner[2:], full[2:]):
            raise Reject(f"bmm operand {node3.name} broadcasts a matrix dimension")
        for s_in, s_out in zip(inner[:2], full[:2]):
            if not (same_size(s_in, s_out) or same_size(s_in, 1)):
                raise Reject(f"bmm operand {node3.name} has an impossible expand")
    return src, full, views


def _unrepeat_kv(node: fx.Node) -> tuple[fx.Node, int, list[fx.Node]]:
    """repeat_kv: reshape([clone](expand(unsqueeze(K, 2), [B, Hkv, n, S, D])), [B, Hkv*n, S, D]) → (K, n)."""
    if not gu.is_call(node, *_RESHAPES):
        return node, 1, []
    views = [node]
    src = node.args[0]
    while gu.is_call(src, *_PASS_THROUGH):
        views.append(src)
        src = src.args[0]
    if not gu.is_call(src, aten.expand.default):
        return node, 1, []
    expand = src
    unsq = expand.args[0]
    if not gu.is_call(unsq, aten.unsqueeze.default) or _norm_dim(unsq.args[1], 5) != 2:
        return node, 1, []
    k = unsq.args[0]
    ks, es, out = _shape(k), _shape(expand), _shape(node)
    if len(ks) != 4 or len(es) != 5 or len(out) != 4:
        return node, 1, []
    n = gu.static_int(es[2])
    if n is None or not (_same_shape(es[:2], ks[:2]) and _same_shape(es[3:], ks[2:])):
        return node, 1, []
    if not (same_size(out[0], ks[0]) and same_size(out[1], size_expr(ks[1]) * n) and _same_shape(out[2:], ks[2:])):
        return node, 1, []
    return k, n, views + [expand, unsq]


def _key_of_transposed(node: fx.Node) -> fx.Node:
    """M = Kᵀ over the last two dims (transpose or permute) → K."""
    if gu.is_call(node, aten.transpose.int):
        dims = sorted(_norm_dim(d, 4) for d in node.args[1:3])
        if dims == [2, 3]:
            return node.args[0]
    if gu.is_call(node, aten.permute.default) and [_norm_dim(d, 4) for d in node.args[1]] == [0, 1, 3, 2]:
        return node.args[0]
    raise Reject(f"the key operand {node.name} is not a transpose of the last two dimensions")


def _check_heads(q: fx.Node, kv: fx.Node, repeat: int, broadcast_heads: Any, what: str) -> None:
    """The composed head mapping must be query head h → kv head h // (Hq / Hkv)."""
    qs, ks = _shape(q), _shape(kv)
    if len(qs) != 4 or len(ks) != 4:
        raise Reject(f"{what} is not 4-D")
    if not same_size(qs[0], ks[0]):
        raise Reject(f"{what} batch differs from the query batch")
    hq, hkv = gu.static_int(qs[1]), gu.static_int(ks[1])
    if hq is None or hkv is None:
        raise Reject("head counts are not static")
    heads_after_repeat = hkv * repeat
    if broadcast_heads is not None and not same_size(broadcast_heads, heads_after_repeat):
        if heads_after_repeat != 1:
            raise Reject(f"{what} heads are broadcast from {heads_after_repeat}, not 1")
    elif heads_after_repeat != hq:
        raise Reject(f"{what} has {heads_after_repeat} heads after repeat, the query {hq}")
    if hq % hkv != 0:
        raise Reject(f"{hq} query heads is not a multiple of {hkv} KV heads")


# -- the pass --------------------------------------------------------------------------------------------------------


def _decomposed_softmax(node: Any) -> Optional[tuple[fx.Node, list[fx.Node], int]]:
    """exp(x - amax(x, d)) / sum(exp(x - amax(x, d)), d), softmax as Inductor's decompositions spell it:
    (x, the nodes computing it, d), or None."""
    if not (gu.is_call(node, aten.div.Tensor) and len(node.args) == 2 and not node.kwargs):
        return None
    exp, total = node.args
    if not (gu.is_call(exp, aten.exp.default) and gu.is_call(total, aten.sum.dim_IntList) and total.args[0] is exp):
        return None
    shifted = exp.args[0]
    if not (gu.is_call(shifted, aten.sub.Tensor) and gu.is_call(shifted.args[1], aten.amax.default)):
        return None
    x, row_max = shifted.args
    if row_max.args[0] is not x:
        return None
    dims, max_dims = list(total.args[1]), list(row_max.args[1])
    keeps = (total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False),
             row_max.args[2] if len(row_max.args) > 2 else row_max.kwargs.get("keepdim", False))
    if len(dims) != 1 or dims != max_dims or not all(keeps) or total.kwargs.get("dtype") is not None:
        return None
    return x, [node, total, exp, shifted, row_max], dims[0]


class AttentionPass(GraphPass):
    name = "attention"

    def find(self, gm: fx.GraphModule):
        self._masks = MaskEvaluator(gm)
        for node in list(gm.graph.nodes):
            if gu.is_call(node, *_SDPA_OPS):
                yield AttentionMatch(node, "sdpa")
            elif gu.is_call(node, aten.bmm.default) and self._reads_probabilities(node.args[0]):
                yield AttentionMatch(node, "eager")

    @staticmethod
    def _reads_probabilities(node: Any) -> bool:
        """Cheap anchor test: the left bmm operand comes from a softmax through views, casts and dropout."""
        for _ in range(12):
            if not isinstance(node, fx.Node):
                return False
            if gu.is_call(node, *_SOFTMAX) or _decomposed_softmax(node) is not None:
                return True
            if node.op != "call_function" or not node.args:
                return False
            node = node.args[0]
        return False

    def guard(self, gm: fx.GraphModule, match: AttentionMatch) -> Optional[str]:
        try:
            plan = self._plan_sdpa(gm, match.anchor) if match.kind == "sdpa" else self._plan_eager(gm, match.anchor)
            self._check_plan(plan)
        except (Reject, Unprovable) as exc:
            return str(exc)
        match.plan = plan
        return None

    def replace(self, gm: fx.GraphModule, match: AttentionMatch) -> None:
        plan = match.plan
        first = min(plan.outputs, key=lambda n: list(gm.graph.nodes).index(n))
        with gm.graph.inserting_before(first):
            fused = gu.call(
                gm,
                attention_op.overload,
                (plan.q, plan.k, plan.v),
                dict(causal=plan.spec.causal, scale=plan.scale, q_offset=plan.spec.q_offset, window=plan.spec.window),
            )
            result = _match_layout(gm, fused, plan.outputs)
        for out in plan.outputs:
            if not gu.tensor_meta_matches(result.meta["val"], out.meta["val"]):
                raise RuntimeError(f"ttftc.attention result {result.meta['val'].shape} does not match {out.name}")
            out.replace_all_uses_with(result)

    # -- common checks -------------------------------------------------------------------------------------------
    def _check_plan(self, plan: AttentionPlan) -> None:
        q, k, v = (gu.val(n) for n in (plan.q, plan.k, plan.v))
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise Reject(f"{name} is not a 4-D tensor")
            if not t.dtype.is_floating_point:
                raise Reject(f"{name} has dtype {t.dtype}")
        if not (q.dtype == k.dtype == v.dtype):
            raise Reject(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
        if not (q.device == k.device == v.device):
            raise Reject("q, k, v are on different devices")
        if not same_size(q.shape[-1], k.shape[-1]) or not _same_shape(k.shape[:3], v.shape[:3]):
            raise Reject("q/k head dims or k/v shapes differ")
        if not math.isfinite(plan.scale) or plan.scale <= 0:
            raise Reject(f"scale {plan.scale} is not a positive number")
        expected = tuple(q.shape[:3]) + (v.shape[-1],)
        for out in plan.outputs:
            o = gu.val(out)
            if not isinstance(o, torch.Tensor) or o.dtype != q.dtype or not _same_shape(o.shape, expected):
                raise Reject(f"the attention result {out.name} is not [B, Hq, Sq, Dv] in the query dtype")
        inside = set(plan.region)
        for node in plan.region:
            # One reader, or several that are all part of the pattern (a decomposed softmax reads exp twice).
            if len(node.users) != 1 and not all(user in inside for user in node.users):
                raise Reject(
                    f"the attention scores/probabilities ({node.name}) have other users (output_attentions?)"
                )

    # -- eager attention -----------------------------------------------------------------------------------------
    def _plan_eager(self, gm: fx.GraphModule, bmm_pv: fx.Node) -> AttentionPlan:
        region: list[fx.Node] = []
        # Output: bmm(P, V) [B*H, Sq, Dv] → view [B, H, Sq, Dv].
        _single_user(bmm_pv, "the attention output bmm")
        out = next(iter(bmm_pv.users))
        if not gu.is_call(out, *_RESHAPES) or len(_shape(out)) != 4:
            raise Reject("the attention output bmm is not reshaped back to [B, H, Sq, D]")
        region.append(bmm_pv)

        probs, p_full, p_views = _merged_heads(bmm_pv.args[0])
        region += p_views
        v_rep, v_full, v_views = _merged_heads(bmm_pv.args[1])
        if not _same_shape(p_full[:2], v_full[:2]):
            raise Reject("probabilities and values disagree on batch/heads")

        # Softmax side: casts / no-op dropout, softmax, casts.
        node = probs
        while True:
            if gu.is_call(node, *_PASS_THROUGH, *_CASTS):
                region.append(node)
                node = node.args[0]
                continue
            if gu.is_call(node, aten.native_dropout.default) or (
                node.op == "call_function" and "dropout" in gu.op_label(node.target)
            ):
                raise Reject("dropout with p > 0 on the attention probabilities")
            if node.op == "call_function" and node.target is operator.getitem:
                if gu.is_call(node.args[0], aten.native_dropout.default):
                    p, train = node.args[0].args[1], node.args[0].args[2]
                    if train and p > 0:
                        raise Reject(f"dropout with p={p} > 0 on the attention probabilities")
                raise Reject(f"the probabilities come from {node.args[0].name}, not a softmax")
            bernoulli = (aten.bernoulli.p, aten.bernoulli.default, aten.bernoulli_.float)
            if gu.is_call(node, aten.mul.Tensor) and any(gu.is_call(a, *bernoulli) for a in node.args):
                raise Reject("dropout with p > 0 on the attention probabilities")
            break
        decomposed = _decomposed_softmax(node)
        if not gu.is_call(node, *_SOFTMAX) and decomposed is None:
            source = gu.op_label(node.target) if node.op == "call_function" else node.name
            raise Reject(f"the probabilities come from {source}, not a softmax")
        softmax_input, softmax_nodes, softmax_dim = decomposed or (node.args[0], [node], node.args[1])
        if _norm_dim(softmax_dim, len(_shape(node))) != len(_shape(node)) - 1:
            raise Reject("softmax is not over the key dimension")
        region += softmax_nodes
        node = softmax_input
        while gu.is_call(node, *_CASTS):
            region.append(node)
            node = node.args[0]

        # Mask.
        spec, scores_end = self._eager_mask(gm, node, region)
        # Scale, back to bmm(Q, Kᵀ).
        scale, scores4 = self._eager_scale(gm, scores_end, region)
        if not gu.is_call(scores4, *_RESHAPES) or not gu.is_call(scores4.args[0], aten.bmm.default):
            raise Reject("the scores are not a reshaped bmm(q, kᵀ)")
        bmm_qk = scores4.args[0]
        region += [scores4, bmm_qk]
        s4 = _shape(scores4)
        if len(s4) != 4 or not _same_shape(s4, p_full):
            raise Reject("scores and probabilities shapes differ")

        q, q_full, _ = _merged_heads(bmm_qk.args[0])
        if not _same_shape(_shape(q), q_full):
            raise Reject("the query is broadcast into the scores")
        kt, kt_full, _ = _merged_heads(bmm_qk.args[1])
        k_rep = _key_of_transposed(kt)
        k, k_repeat, _ = _unrepeat_kv(k_rep)
        v, v_repeat, _ = _unrepeat_kv(v_rep)
        _check_heads(q, k, k_repeat, kt_full[1] if not same_size(_shape(kt)[1], kt_full[1]) else None, "the key")
        _check_heads(q, v, v_repeat, v_full[1] if not same_size(_shape(v_rep)[1], v_full[1]) else None, "the value")
        if not _same_shape(_shape(out), (q_full[0], q_full[1], q_full[2], _shape(v)[3])):
            raise Reject("the attention output is not [B, Hq, Sq, Dv]")

        # The mask must describe the scores' own axes.
        return AttentionPlan(q, k, v, [out], spec, scale, region)

    def _eager_mask(self, gm: fx.GraphModule, node: fx.Node, region: list[fx.Node]) -> tuple[MaskSpec, fx.Node]:
        """The masking step before the softmax: (what it proves, the scores node it applies to)."""
        if gu.is_call(node, aten.add.Tensor) and isinstance(node.args[1], fx.Node):
            a, b = node.args[0], node.args[1]
            scores, mask = (a, b) if self._leads_to_scores(a) else (b, a) if self._leads_to_scores(b) else (None, None)
            if scores is None:
                raise Reject("neither side of the mask add is the attention scores")
            if node.kwargs.get("alpha", 1) != 1:
                raise Reject("the mask is added with alpha != 1")
            region.append(node)
            return prove_mask(self._masks, mask, _shape(node), kind="additive"), scores
        if gu.is_call(node, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf):
            cond, x, y = node.args[0], node.args[1], node.args[2]
            if self._leads_to_scores(x) and self._masking_constant(gm, y):
                scores, negate = x, False
            elif self._leads_to_scores(y) and self._masking_constant(gm, x):
                scores, negate = y, True
            else:
                raise Reject("where() on the scores does not select between the scores and a masking value")
            region.append(node)
            return prove_mask(self._masks, cond, _shape(node), kind="hidden" if negate else "visible"), scores
        if gu.is_call(node, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            scores, mask, value = node.args
            if not self._masking_constant(gm, value):
                raise Reject("masked_fill on the scores with a value that does not mask")
            region.append(node)
            return prove_mask(self._masks, mask, _shape(node), kind="hidden"), scores
        return MaskSpec(causal=False), node

    @staticmethod
    def _masking_constant(gm: fx.GraphModule, x: Any) -> bool:
        value = _scalar_constant(gm, x)
        return value is not None and hides(value)

    def _leads_to_scores(self, node: Any) -> bool:
        """Whether `node` is the scaled scores: scale ops and casts over a reshaped bmm."""
        for _ in range(8):
            if not isinstance(node, fx.Node) or node.op != "call_function":
                return False
            if gu.is_call(node, *_RESHAPES) and gu.is_call(node.args[0], aten.bmm.default):
                return True
            if gu.is_call(node, aten.mul.Tensor, aten.div.Tensor, aten.tanh.default, *_CASTS):
                node = node.args[0]
                continue
            return False
        return False

    def _eager_scale(self, gm: fx.GraphModule, node: fx.Node, region: list[fx.Node]) -> tuple[float, fx.Node]:
        scale = 1.0
        while True:
            if gu.is_call(node, aten.tanh.default):
                raise Reject("soft-capping (tanh on the scores) is not implemented by ttftc.attention")
            if gu.is_call(node, aten.mul.Tensor, aten.div.Tensor):
                a, b = node.args[0], node.args[1]
                if self._leads_to_scores(a):
                    c, rest = _scalar_constant(gm, b), a
                elif node.target is aten.mul.Tensor and self._leads_to_scores(b):
                    c, rest = _scalar_constant(gm, a), b
                else:
                    raise Reject("the scores are multiplied by something other than a constant")
                if c is None:
                    other = b if rest is a else a
                    source = gu.through_views(other)
                    while gu.is_call(source, *_CASTS):
                        source = source.args[0]
                    if isinstance(source, fx.Node) and source.op == "placeholder":
                        raise Reject("the softmax scale is a runtime input (a dynamic float), not a constant")
                    raise Reject("the scores are scaled by a non-constant tensor")
                if c == 0:
                    raise Reject("the scores are scaled by zero")
                scale = scale * c if node.target is aten.mul.Tensor else scale / c
                region.append(node)
                node = rest
                continue
            if gu.is_call(node, *_CASTS):
                region.append(node)
                node = node.args[0]
                continue
            return scale, node

    # -- SDPA ------------------------------------------------------------------------------------------------------
    def _plan_sdpa(self, gm: fx.GraphModule, node: fx.Node) -> AttentionPlan:
        args = _bind(node)
        dropout = args.get("dropout_p", 0.0)
        if not isinstance(dropout, (int, float)) or dropout != 0:
            raise Reject(f"dropout with p={dropout} > 0 in SDPA")
        if args.get("dropout_mask") is not None:
            raise Reject("SDPA with an explicit dropout mask")
        q, k_rep, v_rep = args["query"], args["key"], args["value"]
        k, k_repeat, _ = _unrepeat_kv(k_rep)
        v, v_repeat, _ = _unrepeat_kv(v_rep)
        # SDPA itself maps heads as GQA (h → h // (Hq / Hkv)); repeat_kv before it composes to the same.
        for kv, rep, what in ((k, k_repeat, "the key"), (v, v_repeat, "the value")):
            qs, ks = _shape(q), _shape(kv)
            hq, hkv = gu.static_int(qs[1]), gu.static_int(ks[1])
            if hq is None or hkv is None or hq % (hkv * rep) != 0 or hq % hkv != 0:
                raise Reject(f"{what} head count does not divide the query's")
            if not same_size(qs[0], ks[0]):
                raise Reject(f"{what} batch differs from the query batch")
        mask = args.get("attn_mask", args.get("attn_bias"))
        causal = bool(args.get("is_causal", False))
        if causal and mask is not None:
            raise Reject("SDPA with both is_causal and a mask")
        scores_shape = _shape(q)[:3] + (_shape(k)[2],)
        if causal:
            spec = MaskSpec(causal=True, q_offset=0)  # SDPA's is_causal aligns the diagonal top-left
        elif mask is None:
            spec = MaskSpec(causal=False)
        else:
            if not isinstance(mask, fx.Node):
                raise Reject("SDPA mask is not a tensor")
            kind = "visible" if gu.val(mask).dtype == torch.bool else "additive"
            spec = prove_mask(self._masks, mask, scores_shape, kind=kind)
        scale = args.get("scale")
        if scale is None:
            d = gu.static_int(_shape(q)[-1])
            if d is None:
                raise Reject("head dim is not static")
            scale = 1.0 / math.sqrt(d)
        if not isinstance(scale, (int, float)):
            raise Reject("the SDPA scale is not a constant")

        if isinstance(gu.val(node), torch.Tensor):
            outputs = [node]
        else:
            outputs = []
            for user in node.users:
                if user.op != "call_function" or user.target is not operator.getitem:
                    raise Reject(f"SDPA result used by {user.name} as a tuple")
                if user.args[1] != 0:
                    raise Reject(f"SDPA's auxiliary output {user.args[1]} (weights / logsumexp) has users")
                outputs.append(user)
            if not outputs:
                raise Reject("SDPA result is unused")
        return AttentionPlan(q, k, v, outputs, spec, float(scale))


def _hint(x: Any) -> int:
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else int(x.node.shape_env.size_hint(x.node.expr))
    return int(x)


def _match_layout(gm: fx.GraphModule, fused: fx.Node, originals: list[fx.Node]) -> fx.Node:
    """Give the fused result the memory layout of the nodes it replaces, copying only where a reader needs it.

    ttftc.attention is declared contiguous [B, H, S, D], but a lowering may return another layout: CPU flash
    attention writes [B, H, S, D] laid out as [B, S, H, D]. Two cases:
    - the replaced result is row-major (the eager form: a reshaped bmm). Hugging Face reads it as
      transpose(1, 2) → clone(contiguous), which gives the same values and strides whatever the layout it starts
      from, so the fused result is used as is: on CPU that clone is then a plain copy of an already [B, S, H, D]
      buffer. Any other reader (a view, the graph output...) gets a contiguous clone, so it sees the strides it
      was traced with.
    - the replaced result has another layout (SDPA's CPU kernel: [B, S, H, D] strides) and the graph after it
      relies on it (a `view` after a transpose): a permuted copy restores it.
    Dimensions of extent 1 carry no layout (their stride is never used), so they are left out of the comparison.
    """
    val = originals[0].meta["val"]
    strides = [_hint(s) for s in val.stride()]
    sizes = [_hint(s) for s in val.shape]
    extended = [d for d in range(val.dim()) if sizes[d] > 1]
    outer_first = sorted(extended, key=lambda d: (-strides[d], d))
    if outer_first == extended:
        if all(_reads_any_layout(user) for out in originals for user in out.users):
            return fused
        return gu.call(gm, aten.clone.default, (fused,), {"memory_format": torch.contiguous_format})
    order = outer_first + [d for d in range(val.dim()) if sizes[d] <= 1]
    inverse = [order.index(d) for d in range(val.dim())]
    permuted = gu.call(gm, aten.permute.default, (fused, order))
    packed = gu.call(gm, aten.clone.default, (permuted,), {"memory_format": torch.contiguous_format})
    return gu.call(gm, aten.permute.default, (packed, inverse))


def _reads_any_layout(node: fx.Node) -> bool:
    """Whether `node` (reading a tensor whose real strides may differ from its meta) computes the values and the
    strides it was traced with: a transpose/permute chain that only ends in contiguous clones."""
    if gu.is_call(node, aten.clone.default):
        return node.kwargs.get("memory_format") == torch.contiguous_format
    if gu.is_call(node, aten.transpose.int, aten.permute.default):
        return bool(node.users) and all(_reads_any_layout(user) for user in node.users)
    return False


def _bind(node: fx.Node) -> dict[str, Any]:
    """An op node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound
