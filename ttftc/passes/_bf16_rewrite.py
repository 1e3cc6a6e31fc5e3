"""The bf16 policy's rewrites: each candidate's GEMM or attention in bf16, with casts at its boundary.

The activations are cast at each op's boundary, so what flows between ops keeps its dtype: the residual stream,
norm statistics and softmax accumulation stay fp32, and the logits come out fp32. `REWRITES[kind]` rewrites a
candidate of that kind (insertion point already set) and returns the node that replaces it, or None when it
re-pointed the candidate's tuple outputs itself.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ttftc import fx_utils as gu
from ttftc.passes._precision_common import FLOATS, Casts, is_cast_to, rewire_tuple

aten = torch.ops.aten
ttftc_ops = torch.ops.ttftc
_SDPA_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default


def linear(casts: Casts, gm: fx.GraphModule, c) -> Optional[fx.Node]:
    bf16, out_dtype = torch.bfloat16, gu.dtype_of(c.node)
    x = casts.cast(gm, c.info["x"], bf16)
    w_bf16 = gu.add_constant(gm, f"{c.name}_w_bf16", c.info["weight"].to(bf16))
    w = gu.call(gm, aten.permute.default, (w_bf16, [1, 0]))
    if c.info["bias"] is not None:
        bias = gu.add_constant(gm, f"{c.name}_b_bf16", c.info["bias"].to(bf16))
        out = gu.call(gm, aten.addmm.default, (bias, x, w))
    else:
        out = gu.call(gm, aten.mm.default, (x, w))
    return casts.restore(gm, out, out_dtype)


def gated_ffn(casts: Casts, gm: fx.GraphModule, c) -> Optional[fx.Node]:
    a, bf16 = c.info["args"], torch.bfloat16
    out = gu.call(gm, ttftc_ops.gated_ffn.default, (
        casts.cast(gm, a["x"], bf16),
        casts.const_like(gm, a["w_gate_up"], bf16, f"{c.name}_w_gate_up"),
        casts.const_like(gm, a["w_down"], bf16, f"{c.name}_w_down"),
        casts.const_like(gm, a.get("b_gate_up"), bf16, f"{c.name}_b_gate_up"),
        casts.const_like(gm, a.get("b_down"), bf16, f"{c.name}_b_down"),
    ), {"act": a["act"]})
    return casts.restore(gm, out, gu.dtype_of(c.node))


def linear_act(casts: Casts, gm: fx.GraphModule, c) -> Optional[fx.Node]:
    a, bf16 = c.info["args"], torch.bfloat16
    out = gu.call(gm, ttftc_ops.linear_act.default, (
        casts.cast(gm, a["x"], bf16),
        casts.const_like(gm, a["w"], bf16, f"{c.name}_w"),
        casts.const_like(gm, a.get("b"), bf16, f"{c.name}_b"),
    ), {"act": a["act"]})
    return casts.restore(gm, out, gu.dtype_of(c.node))


def norm_linear(casts: Casts, gm: fx.GraphModule, c) -> Optional[fx.Node]:
    # The residual add stays fp32 (it is the residual stream); the norm statistics are fp32 inside the op.
    a, bf16 = c.info["args"], torch.bfloat16
    x = a["x"]
    if a.get("residual") is not None:
        x = gu.call(gm, aten.add.Tensor, (x, a["residual"]))
    out_dtype = gu.dtype_of(c.node.meta["val"][0] if isinstance(c.node.meta["val"], (list, tuple)) else c.node)
    new = gu.call(gm, ttftc_ops.norm_linear.default, (
        gu.call(gm, aten._to_copy.default, (x,), {"dtype": bf16}),
        casts.const_like(gm, a["norm_w"], bf16, f"{c.name}_norm_w"),
        casts.const_like(gm, a.get("norm_b"), bf16, f"{c.name}_norm_b"),
        casts.const_like(gm, a["w"], bf16, f"{c.name}_w"),
        casts.const_like(gm, a.get("b"), bf16, f"{c.name}_b"),
        None,
    ), {"kind": a["kind"], "eps": a["eps"]})
    out = casts.restore(gm, gu.call(gm, operator.getitem, (new, 0)), out_dtype)
    rewire_tuple(c.node, {0: out, 1: x if a.get("residual") is not None else None})
    return None


def attention(casts: Casts, gm: fx.GraphModule, c) -> Optional[fx.Node]:
    # Same argument spelling as the original node (FLOP formulas bind them the way the pass wrote them).
    args = [casts.cast(gm, a, torch.bfloat16) for a in c.node.args[:3]] + list(c.node.args[3:])
    out = gu.call(gm, ttftc_ops.attention.default, tuple(args), dict(c.node.kwargs))
    return casts.restore(gm, out, gu.dtype_of(c.node))


def sdpa(casts: Casts, gm: fx.GraphModule, c) -> Optional[fx.Node]:
    bf16 = torch.bfloat16
    args = list(c.node.args)
    args[:3] = [casts.cast(gm, a, bf16) for a in args[:3]]
    kwargs = dict(c.node.kwargs)
    mask = kwargs.get("attn_mask")
    if mask is not None and gu.dtype_of(mask) in FLOATS:
        kwargs["attn_mask"] = casts.cast(gm, mask, bf16)
    new = gu.call(gm, _SDPA_CPU, tuple(args), kwargs)
    out = casts.restore(gm, gu.call(gm, operator.getitem, (new, 0)), gu.dtype_of(c.node.args[0]))
    rewire_tuple(c.node, {0: out})
    return None


def bmm(casts: Casts, gm: fx.GraphModule, c) -> Optional[fx.Node]:
    a, b = (casts.cast(gm, n, torch.bfloat16) for n in c.node.args[:2])
    return casts.restore(gm, gu.call(gm, aten.bmm.default, (a, b)), gu.dtype_of(c.node))



REWRITES = {"linear": linear, "gated_ffn": gated_ffn, "linear_act": linear_act, "norm_linear": norm_linear,
            "attention": attention, "sdpa": sdpa, "bmm": bmm}


# -- cast round trips ---------------------------------------------------------------------------------------


def _reads_any_float(node: fx.Node, arg: fx.Node) -> bool:
    """Consumers for which a bf16 input is as good as the same values widened to fp32."""
    if is_cast_to(node, torch.bfloat16):
        return True
    if gu.is_call(node, ttftc_ops.int8_linear.default, ttftc_ops.gated_ffn_int8.default):
        return node.args[0] is arg and node.args[1] is None
    return gu.is_call(node, ttftc_ops.quantize_per_token.default)


def elide_round_trips(gm: fx.GraphModule) -> None:
    """bf16 → fp32 → (row views) → bf16 (or → an int8 quantiser) reads the bf16 tensor directly.

    Widening bf16 to fp32 is exact, so the round trip only costs two passes over memory; it appears where one
    bf16 op feeds another through views (attention → o_proj, the v projection → attention).
    """
    for widen in list(gm.graph.nodes):
        if not (is_cast_to(widen, torch.float32) and gu.dtype_of(widen.args[0]) == torch.bfloat16):
            continue
        stack = [(widen, [])]
        while stack:
            node, chain = stack.pop()
            for user in list(node.users):
                if user.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                                   aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
                                   aten.clone.default) and user.op == "call_function":
                    stack.append((user, chain + [user]))
                elif _reads_any_float(user, node):
                    with gm.graph.inserting_before(user):
                        x = widen.args[0]
                        for view in chain:
                            x = gu.call(gm, view.target, (x, *view.args[1:]), dict(view.kwargs))
                    if is_cast_to(user, torch.bfloat16):
                        user.replace_all_uses_with(x)
                    else:
                        user.args = (x, *user.args[1:])

