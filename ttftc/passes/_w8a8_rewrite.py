"""The int8 policy's rewrites: W8A8 linears with quantisation fused into the producer, dequantisation in the
GEMM's epilogue.

Weights are quantised here, once, symmetric per output channel; activations per token at run time.
ttftc.norm_linear becomes ttftc.norm_quant → ttftc.int8_linear, gated_ffn becomes ttftc.gated_ffn_int8 (its
act·mul epilogue quantises for the down GEMM), and after every candidate is rewritten `fuse_quant_producers` moves
the remaining per-GEMM quantisation into the producer: a ttftc.norm feeding int8 GEMMs becomes ttftc.norm_quant,
and several int8 GEMMs reading one activation share one ttftc.quantize_per_token. Dequantisation (x_scale·w_scale,
bias, output dtype) is the GEMM's epilogue.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ttftc.ops.int8_linear import quantize_per_token
from ttftc import fx_utils as gu
from ttftc.passes._linear import up_row_views
from ttftc.passes._precision_common import FLOATS, Casts, rewire_tuple

aten = torch.ops.aten
ttftc_ops = torch.ops.ttftc
_ACT_NODES = {
    "silu": (aten.silu.default, {}),
    "relu": (aten.relu.default, {}),
    "gelu": (aten.gelu.default, {}),
    "gelu_tanh": (aten.gelu.default, {"approximate": "tanh"}),
}


def _int8_weight(gm: fx.GraphModule, weight: torch.Tensor, hint: str) -> tuple[fx.Node, fx.Node]:
    q, scale = quantize_per_token(weight)  # per row of [N, K] = per output channel
    return gu.add_constant(gm, f"{hint}_int8", q), gu.add_constant(gm, f"{hint}_scale", scale.float())


def linear(casts: Casts, gm: fx.GraphModule, c) -> Optional[fx.Node]:
    wq, ws = _int8_weight(gm, c.info["weight"], c.name)
    bias = casts.const_like(gm, c.info["bias_node"], torch.float32, f"{c.name}_bias")
    return gu.call(gm, ttftc_ops.int8_linear.default, (c.info["x"], None, wq, ws, bias),
                   {"out_dtype": gu.dtype_of(c.node)})


def linear_act(casts: Casts, gm: fx.GraphModule, c) -> Optional[fx.Node]:
    a = c.info["args"]
    wq, ws = _int8_weight(gm, gu.constant_value(gm, a["w"]), c.name)
    out = gu.call(gm, ttftc_ops.int8_linear.default,
                  (a["x"], None, wq, ws, casts.const_like(gm, a.get("b"), torch.float32, f"{c.name}_b")),
                  {"out_dtype": gu.dtype_of(c.node)})
    target, kwargs = _ACT_NODES[a["act"]]
    return gu.call(gm, target, (out,), kwargs)


def gated_ffn(casts: Casts, gm: fx.GraphModule, c) -> Optional[fx.Node]:
    a = c.info["args"]
    gu_q, gu_s = _int8_weight(gm, gu.constant_value(gm, a["w_gate_up"]), f"{c.name}_gate_up")
    d_q, d_s = _int8_weight(gm, gu.constant_value(gm, a["w_down"]), f"{c.name}_down")
    fp32 = torch.float32
    return gu.call(gm, ttftc_ops.gated_ffn_int8.default, (
        a["x"], None, gu_q, gu_s, d_q, d_s,
        casts.const_like(gm, a.get("b_gate_up"), fp32, f"{c.name}_b_gate_up"),
        casts.const_like(gm, a.get("b_down"), fp32, f"{c.name}_b_down"),
    ), {"act": a["act"], "out_dtype": gu.dtype_of(c.node)})


def norm_linear(casts: Casts, gm: fx.GraphModule, c) -> Optional[fx.Node]:
    a = c.info["args"]
    out_val = c.node.meta["val"][0]
    nq = gu.call(gm, ttftc_ops.norm_quant.default,
                 (a["x"], a["norm_w"], a.get("norm_b"), a.get("residual")),
                 {"kind": a["kind"], "eps": a["eps"]})
    q, scale, residual = (gu.call(gm, operator.getitem, (nq, i)) for i in range(3))
    wq, ws = _int8_weight(gm, gu.constant_value(gm, a["w"]), c.name)
    out = gu.call(gm, ttftc_ops.int8_linear.default,
                  (q, scale, wq, ws, casts.const_like(gm, a.get("b"), torch.float32, f"{c.name}_b")),
                  {"out_dtype": out_val.dtype})
    rewire_tuple(c.node, {0: out, 1: residual})
    return None



REWRITES = {"linear": linear, "linear_act": linear_act, "gated_ffn": gated_ffn, "norm_linear": norm_linear}


# -- producer fusion ---------------------------------------------------------------------------------------


def _int8_consumers_without_scale(gm: fx.GraphModule) -> dict[fx.Node, list[tuple[fx.Node, list[fx.Node]]]]:
    """Int8 GEMM nodes that still quantise their own input, grouped by the node that computes that input."""
    groups: dict[fx.Node, list[tuple[fx.Node, list[fx.Node]]]] = {}
    for node in gm.graph.nodes:
        if gu.is_call(node, ttftc_ops.int8_linear.default, ttftc_ops.gated_ffn_int8.default) and node.args[1] is None:
            root, chain = up_row_views(node.args[0])
            if isinstance(root, fx.Node) and gu.dtype_of(root) in FLOATS:
                groups.setdefault(root, []).append((node, chain))
    return groups


def _all_users_are(root: fx.Node, consumers: set[fx.Node]) -> bool:
    for user in root.users:
        if user in consumers:
            continue
        if gu.is_call(user, *gu.VIEW_OPS) and user.users and _all_users_are(user, consumers):
            continue
        return False
    return True


def fuse_quant_producers(gm: fx.GraphModule) -> None:
    """Move each int8 GEMM's activation quantisation into the op that produces the activation.

    A ttftc.norm whose output only feeds int8 GEMMs becomes ttftc.norm_quant; an activation read by several
    int8 GEMMs gets one shared ttftc.quantize_per_token. A lone consumer of anything else keeps quantising in
    its own prologue, which is the same work without an extra round trip through memory.
    """
    for root, consumers in _int8_consumers_without_scale(gm).items():
        nodes = {n for n, _ in consumers}
        is_norm_output = (
            gu.is_call(root, operator.getitem)
            and root.args[1] == 0
            and gu.is_call(root.args[0], ttftc_ops.norm.default)
            and _all_users_are(root, nodes)
        )
        if is_norm_output:
            norm = root.args[0]
            args = gu.bound_arguments(norm)
            with gm.graph.inserting_before(norm):
                nq = gu.call(gm, ttftc_ops.norm_quant.default,
                             (args["x"], args["norm_w"], args.get("norm_b"), args.get("residual")),
                             {"kind": args["kind"], "eps": args["eps"]})
                q, scale, residual = (gu.call(gm, operator.getitem, (nq, i)) for i in range(3))
            for user in gu.getitem_users(norm).get(1, []):
                user.replace_all_uses_with(residual)
        elif len(consumers) >= 2:
            with gm.graph.inserting_after(root):
                quant = gu.call(gm, ttftc_ops.quantize_per_token.default, (root,))
            with gm.graph.inserting_after(quant):
                q = gu.call(gm, operator.getitem, (quant, 0))
            with gm.graph.inserting_after(q):
                scale = gu.call(gm, operator.getitem, (q.args[0], 1))
        else:
            continue
        for consumer, chain in consumers:
            with gm.graph.inserting_before(consumer):
                x = q
                for view in reversed(chain):  # replay the row views that led from the producer to the GEMM
                    x = gu.call(gm, view.target, (x, *view.args[1:]), dict(view.kwargs))
            consumer.args = (x, scale, *consumer.args[2:])

