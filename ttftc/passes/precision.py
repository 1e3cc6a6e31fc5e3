"""The precision policy: bf16 GEMMs and attention, or W8A8 int8 linears, chosen per layer at compile time.

Config.precision:
  "fp32"  the pass does nothing: the model keeps its numerics.
  "bf16"  every GEMM with frozen weights (plain mm/addmm and the fused ttftc.norm_linear / gated_ffn /
          linear_act) and attention (ttftc.attention, SDPA, eager bmm) run in bf16. The activations are cast
          at each op's boundary, so what flows between ops keeps its dtype: the residual stream, norm
          statistics and softmax accumulation stay fp32, and the logits (the lm_head's output) come out fp32.
  "int8"  W8A8: weights are quantised here, once, symmetric per output channel; activations per token at run
          time. The quantisation is fused into the producer: ttftc.norm_linear becomes ttftc.norm_quant →
          ttftc.int8_linear, a ttftc.norm feeding int8 GEMMs becomes ttftc.norm_quant, gated_ffn becomes
          ttftc.gated_ffn_int8 (its act·mul epilogue quantises for the down GEMM), and several int8 GEMMs
          reading one activation share one ttftc.quantize_per_token. Dequantisation (x_scale·w_scale, bias,
          output dtype) is the GEMM's epilogue. Whatever is not quantised gets the bf16 policy: attention,
          the layers named in Config.quant_skip (the lm_head by default), and every layer refused for int8.

A layer is refused for int8, with its reason in explain, when its weights hold NaN or inf or its shape is not
one the int8 kernels support; it stays bf16. When the graph's device has no int8 path at all, the whole graph
falls back to bf16 with a warning.

Quant-dequant patterns already in the graph are fused into ttftc.int8_linear in the bf16 and int8 modes:
torch.ao PT2E quantize_per_tensor → dequantize_per_tensor feeding a linear over dequantize_per_channel (or
_per_tensor) of a frozen int8 weight, symmetric only; and torchao-style `torch._int_mm(x_q, W_q^T)` followed by
the per-token and per-channel scale multiplies and an optional bias, including torchao's CPU form (x_q + 128 as
uint8 plus a column-sum correction) and weights that reach the graph as live inputs (tensor subclasses that
AOTAutograd desugared instead of freezing).

Module names for Config.quant_skip come from each node's `nn_module_stack`, which survives AOTAutograd on the
mm/addmm of every nn.Linear ("model.layers.0.mlp.down_proj", "lm_head"). Fused ttftc nodes are new and carry
none, but their outputs still feed the view nodes that followed the original linears, which keep theirs: a
fused node is named by those (a norm_linear feeding the lm_head is "lm_head"; a merged q/k/v projection is
"...q_proj+...k_proj+...v_proj"; a gated_ffn is "...mlp.down_proj"). A fragment matches when it is contained
in one of the names or equals the op kind ("gated_ffn", "norm_linear", "linear").
"""

from __future__ import annotations

import operator
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from ttftc.ops.int8_linear import quantize_per_token
from ttftc.passes import graph_utils as gu
from ttftc.passes._linear import match_linear, up_row_views
from ttftc.passes.base import GraphPass
from ttftc.passes.registry import register_pass

aten = torch.ops.aten
ttftc_ops = torch.ops.ttftc

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# Input dtypes the bf16 policy lowers (bf16 models are already there; fp16 keeps its own numerics).
WIDE_FLOATS = (torch.float32,)
# The int8 kernels (Triton tiles, torch._int_mm on CUDA, npu_quant_matmul) want both GEMM dimensions in whole
# multiples of 8 and a reduction of at least 16; every transformer width is, so a refusal flags an odd layer.
INT8_ALIGN = 8
INT8_MIN_K = 16

_SDPA_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
_ACT_NODES = {
    "silu": (aten.silu.default, {}),
    "relu": (aten.relu.default, {}),
    "gelu": (aten.gelu.default, {}),
    "gelu_tanh": (aten.gelu.default, {"approximate": "tanh"}),
}


def int8_unavailable_reason(device_type: str) -> Optional[str]:
    """None when `device_type` has an int8 GEMM path ttftc can lower to, else why not."""
    if device_type in ("cpu", "cuda"):
        return None if hasattr(torch, "_int_mm") else "this torch has no torch._int_mm"
    if device_type == "npu":
        from ttftc.codegen.npu import _torch_npu

        return _torch_npu.unavailable_reason()
    return f"no int8 GEMM lowering for device {device_type!r}"


def int8_shape_refusal(n: int, k: int) -> Optional[str]:
    if k % INT8_ALIGN or n % INT8_ALIGN or k < INT8_MIN_K:
        return (
            f"shape [{n}, {k}] unsupported by the int8 kernels (in/out features must be multiples of "
            f"{INT8_ALIGN}, in_features >= {INT8_MIN_K})"
        )
    return None


def int8_weight_refusal(weight: torch.Tensor) -> Optional[str]:
    if weight.dim() != 2 or not weight.is_floating_point():
        return f"weight is not a 2-D float matrix ({tuple(weight.shape)}, {weight.dtype})"
    if not bool(torch.isfinite(weight).all()):
        return "weights contain NaN or inf"
    return int8_shape_refusal(int(weight.shape[0]), int(weight.shape[1]))


# -- module names ------------------------------------------------------------------------------------------


def _clean_path(path: str) -> str:
    path = re.sub(r"^L\['[^']+'\]\.?", "", path)
    path = re.sub(r"\.?_modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".")


def module_path(node: fx.Node) -> Optional[str]:
    """The innermost module a node was traced in, as a dotted path ("model.layers.0.mlp.down_proj")."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, tuple) else path
    return _clean_path(str(path))


def _downstream_paths(node: fx.Node, depth: int = 5) -> list[str]:
    """Module paths of the first traced nodes downstream of `node` on each branch.

    A fused op's outputs still flow into the view nodes that followed the original linears, and those keep their
    `nn_module_stack` (the view after `mm` belongs to the nn.Linear), so they name the layers the op absorbed.
    """
    found: list[str] = []
    # Only the op's main output: a norm_linear's second output is the residual stream, read by the next layer.
    frontier, seen = list(_getitems(node).get(0, [])) or list(node.users), {node}
    for _ in range(depth):
        following = []
        for n in frontier:
            if n in seen or _feeds_gemm(n):
                continue  # a view that flattens the input of the *next* linear belongs to that linear
            seen.add(n)
            path = module_path(n)
            if path:
                found.append(path)
            else:
                following.extend(n.users)
        frontier = following
    # "model.layers.0" (the residual add) adds nothing next to "model.layers.0.mlp.down_proj".
    unique = sorted(set(found))
    return [p for p in unique if not any(o != p and o.startswith(p + ".") for o in unique)]


def _activation_input(node: fx.Node) -> Any:
    if gu.is_call(node, aten.mm.default):
        return node.args[0]
    if gu.is_call(node, aten.addmm.default):
        return node.args[1]
    if node.op == "call_function" and getattr(node.target, "namespace", None) == "ttftc" and node.args:
        return node.args[0]
    return None


def _feeds_gemm(node: fx.Node) -> bool:
    """A view whose user reads it as a GEMM's activation input (the flattening inside the next nn.Linear)."""
    return gu.is_call(node, *gu.VIEW_OPS) and any(_activation_input(u) is node for u in node.users)


def node_module_names(node: fx.Node) -> list[str]:
    """The module paths a node computes for: its own, or for a fused node the layers its outputs feed."""
    own = module_path(node)
    return [own] if own else _downstream_paths(node)


def describe(node: fx.Node, op_name: str) -> str:
    names = node_module_names(node)
    if module_path(node):
        return names[0]
    return f"{'+'.join(names) or '?'} ({op_name})"


# -- matches -----------------------------------------------------------------------------------------------


@dataclass
class Candidate:
    kind: str  # linear | norm_linear | gated_ffn | linear_act | attention | sdpa | bmm | pt2e | int_mm
    node: fx.Node
    name: str  # for explain: the module path(s), see `describe`
    plan: str = ""  # "int8" or "bf16", decided by guard
    info: dict = field(default_factory=dict)


def _kwargs_of(node: fx.Node) -> Optional[dict]:
    """All arguments of an op node by schema name (defaults filled in), or None if they do not bind."""
    norm = normalize_function(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    if norm is None:
        return None
    bound = dict(norm.kwargs)
    for arg in node.target._schema.arguments:
        if arg.name not in bound and arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _getitems(node: fx.Node) -> dict[int, list[fx.Node]]:
    result: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            result.setdefault(int(user.args[1]), []).append(user)
        else:
            result.setdefault(-1, []).append(user)
    return result


def _dtype(node: Any) -> Optional[torch.dtype]:
    value = gu.val(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


@register_pass
class PrecisionPass(GraphPass):
    name = "precision"
    order = 40

    def options(self) -> dict:
        return {
            "precision": self.config.precision,
            "quant_skip": list(self.config.quant_skip),
            "int8_align": INT8_ALIGN,
            "int8_min_k": INT8_MIN_K,
        }

    # -- driver additions ------------------------------------------------------------------------------------
    def run(self, gm: fx.GraphModule):
        self._casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.mode = self._effective_precision(gm)
        stats = super().run(gm)
        if self.mode in ("bf16", "int8"):
            _elide_round_trips(gm)
            if self.mode == "int8":
                _fuse_quant_producers(gm)
            gm.graph.eliminate_dead_code()
            gm.graph.lint()
            gm.recompile()
        return stats

    def _effective_precision(self, gm: fx.GraphModule) -> str:
        precision = self.config.precision
        if precision != "int8":
            return precision
        device = _graph_device(gm)
        reason = int8_unavailable_reason(device)
        if reason is None:
            return "int8"
        message = f"precision='int8' has no int8 path on device {device!r} ({reason}); falling back to bf16"
        warnings.warn(f"ttftc: {message}", RuntimeWarning, stacklevel=2)
        self.stats.reject(message)
        return "bf16"

    # -- find ------------------------------------------------------------------------------------------------
    def find(self, gm: fx.GraphModule) -> Iterable[Candidate]:
        if self.mode == "fp32":
            return []
        found = []
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            candidate = self._classify(gm, node)
            if candidate is not None:
                found.append(candidate)
        return found

    def _classify(self, gm: fx.GraphModule, node: fx.Node) -> Optional[Candidate]:
        target = node.target
        if target in (aten.mm.default, aten.addmm.default):
            pattern = _match_pt2e_linear(gm, node)
            if pattern is not None:
                return Candidate("pt2e", node, describe(node, "linear"), info=pattern)
            return Candidate("linear", node, describe(node, "linear"))
        if target is aten._int_mm.default:
            return Candidate("int_mm", node, describe(node, "int_mm"))
        if target is aten.bmm.default:
            return Candidate("bmm", node, describe(node, "bmm"))
        if target is _SDPA_CPU:
            return Candidate("sdpa", node, describe(node, "attention"))
        for kind in ("norm_linear", "gated_ffn", "linear_act", "attention"):
            if target is getattr(ttftc_ops, kind).default:
                return Candidate(kind, node, describe(node, kind))
        return None

    # -- guard -----------------------------------------------------------------------------------------------
    def guard(self, gm: fx.GraphModule, c: Candidate) -> Optional[str]:
        if c.node.graph is not gm.graph or not c.node.users:
            return f"{c.name}: node no longer in use"
        if c.kind in ("pt2e", "int_mm"):
            return self._guard_existing_quant(gm, c)
        int8_reason = None
        if self.mode == "int8" and c.kind in ("linear", "norm_linear", "gated_ffn", "linear_act"):
            int8_reason = self._int8_refusal(gm, c)
            if int8_reason is None:
                c.plan = "int8"
                return None
        bf16_reason = self._bf16_refusal(gm, c)
        if int8_reason is not None:
            kept = "kept in its own dtype" if bf16_reason else "kept bf16"
            self.stats.reject(f"{c.name}: int8 refused: {int8_reason}; {kept}")
        if bf16_reason is not None:
            return f"{c.name}: bf16 refused: {bf16_reason}"
        c.plan = "bf16"
        return None

    def _skipped_by(self, c: Candidate) -> Optional[str]:
        names = node_module_names(c.node) + [c.kind]
        for fragment in self.config.quant_skip:
            if fragment and any(fragment in name for name in names):
                return fragment
        return None

    def _weights(self, gm: fx.GraphModule, c: Candidate) -> Optional[dict]:
        """The frozen tensors of a GEMM candidate, by role, or None if one of them is not frozen."""
        if c.kind == "linear":
            lin = match_linear(gm, c.node)
            if lin is None:
                return None
            c.info.update(x=lin.x, weight=lin.weight, bias=lin.bias, bias_node=lin.bias_node)
            return {"weight": lin.weight}
        args = _kwargs_of(c.node)
        if args is None:
            return None
        c.info["args"] = args
        roles = {"norm_linear": ("w",), "linear_act": ("w",), "gated_ffn": ("w_gate_up", "w_down")}[c.kind]
        weights = {}
        for role in roles:
            tensor = gu.constant_value(gm, args[role])
            if tensor is None:
                return None
            weights[role] = tensor
        for role in ("b", "b_gate_up", "b_down", "norm_w", "norm_b"):
            if args.get(role) is not None and gu.constant_value(gm, args[role]) is None:
                return None
        return weights

    def _int8_refusal(self, gm: fx.GraphModule, c: Candidate) -> Optional[str]:
        fragment = self._skipped_by(c)
        if fragment is not None:
            return f"skipped by quant_skip fragment {fragment!r}"
        weights = self._weights(gm, c)
        if weights is None:
            return "weights are not frozen constants"
        for role, weight in weights.items():
            reason = int8_weight_refusal(weight)
            if reason is not None:
                return f"{role}: {reason}" if len(weights) > 1 else reason
        x = c.info["x"] if c.kind == "linear" else c.info["args"]["x"]
        if _dtype(x) not in FLOATS:
            return f"activation dtype {_dtype(x)} is not floating point"
        if c.kind == "norm_linear" and c.info["args"].get("kind") not in ("rms", "layer"):
            return f"norm kind {c.info['args'].get('kind')!r}"
        return None

    def _bf16_refusal(self, gm: fx.GraphModule, c: Candidate) -> Optional[str]:
        if c.kind in ("linear", "norm_linear", "gated_ffn", "linear_act"):
            if "weight" not in c.info and "args" not in c.info and self._weights(gm, c) is None:
                return "weights are not frozen constants"
            if c.kind == "linear" and "x" not in c.info and match_linear(gm, c.node) is None:
                return "not a linear with frozen weights"
            x = c.info["x"] if c.kind == "linear" else c.info["args"]["x"]
            return None if _dtype(x) in WIDE_FLOATS else f"activation dtype {_dtype(x)} (only fp32 is lowered)"
        if c.kind == "attention":
            if len(c.node.args) < 3:
                return "q, k, v are not positional"
            q = c.node.args[0]
            return None if _dtype(q) in WIDE_FLOATS else f"query dtype {_dtype(q)}"
        if c.kind == "sdpa":
            items = _getitems(c.node)
            if set(items) - {0} or len(items.get(0, [])) == 0:
                return "the logsumexp output is read"
            mask = c.node.kwargs.get("attn_mask")
            if mask is not None and _dtype(mask) not in (torch.bool,) + FLOATS:
                return f"mask dtype {_dtype(mask)}"
            return None if _dtype(c.node.args[0]) in WIDE_FLOATS else f"query dtype {_dtype(c.node.args[0])}"
        if c.kind == "bmm":
            a, b = c.node.args[:2]
            if gu.constant_value(gm, a) is not None or gu.constant_value(gm, b) is not None:
                return "bmm with a frozen operand"
            return None if _dtype(a) in WIDE_FLOATS and _dtype(b) in WIDE_FLOATS else f"dtype {_dtype(a)}"
        return f"unknown candidate kind {c.kind}"

    def _guard_existing_quant(self, gm: fx.GraphModule, c: Candidate) -> Optional[str]:
        if c.kind == "int_mm":
            pattern = _match_int_mm_chain(gm, c.node)
            if isinstance(pattern, str):
                return f"{c.name}: torch._int_mm pattern: {pattern}"
            c.info = pattern
        reason = c.info.get("refusal")
        if reason is not None:
            return f"{c.name}: quant-dequant pattern: {reason}"
        c.plan = "int8"
        return None

    # -- replace ---------------------------------------------------------------------------------------------
    def replace(self, gm: fx.GraphModule, c: Candidate) -> None:
        handler = getattr(self, f"_{c.plan}_{c.kind}")
        # A torchao chain is replaced at its last multiply: its scale operands may be computed after the _int_mm.
        anchor = c.info["end"] if c.kind == "int_mm" else c.node
        with gm.graph.inserting_before(anchor):
            new = handler(gm, c)
        if new is not None:
            anchor.replace_all_uses_with(new)  # the replaced nodes die in the driver's dead-code elimination

    # shared helpers
    def _cast(self, gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype) -> fx.Node:
        if _dtype(node) == dtype:
            return node
        key = (node, dtype)
        if key not in self._casts:
            # Right after the producer, so one cast serves every consumer wherever they sit.
            with gm.graph.inserting_after(node):
                self._casts[key] = gu.call(gm, aten._to_copy.default, (node,), {"dtype": dtype})
        return self._casts[key]

    def _const_like(self, gm: fx.GraphModule, node: Optional[fx.Node], dtype: torch.dtype, hint: str):
        """A frozen argument converted to `dtype` (a new constant), or a cast node for a live one."""
        if node is None:
            return None
        value = gu.constant_value(gm, node)
        if value is None:
            return self._cast(gm, node, dtype)
        if value.dtype == dtype or not value.is_floating_point():
            return node
        return gu.add_constant(gm, hint, value.to(dtype))

    def _int8_weight(self, gm: fx.GraphModule, weight: torch.Tensor, hint: str) -> tuple[fx.Node, fx.Node]:
        q, scale = quantize_per_token(weight)  # per row of [N, K] = per output channel
        return gu.add_constant(gm, f"{hint}_int8", q), gu.add_constant(gm, f"{hint}_scale", scale.float())

    def _restore(self, gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype) -> fx.Node:
        return node if _dtype(node) == dtype else gu.call(gm, aten._to_copy.default, (node,), {"dtype": dtype})

    # bf16
    def _bf16_linear(self, gm, c):
        bf16, out_dtype = torch.bfloat16, _dtype(c.node)
        x = self._cast(gm, c.info["x"], bf16)
        w = gu.call(gm, aten.t.default, (gu.add_constant(gm, f"{c.name}_w_bf16", c.info["weight"].to(bf16)),))
        if c.info["bias"] is not None:
            bias = gu.add_constant(gm, f"{c.name}_b_bf16", c.info["bias"].to(bf16))
            out = gu.call(gm, aten.addmm.default, (bias, x, w))
        else:
            out = gu.call(gm, aten.mm.default, (x, w))
        return self._restore(gm, out, out_dtype)

    def _bf16_gated_ffn(self, gm, c):
        a, bf16 = c.info["args"], torch.bfloat16
        out = gu.call(gm, ttftc_ops.gated_ffn.default, (
            self._cast(gm, a["x"], bf16),
            self._const_like(gm, a["w_gate_up"], bf16, f"{c.name}_w_gate_up"),
            self._const_like(gm, a["w_down"], bf16, f"{c.name}_w_down"),
            self._const_like(gm, a.get("b_gate_up"), bf16, f"{c.name}_b_gate_up"),
            self._const_like(gm, a.get("b_down"), bf16, f"{c.name}_b_down"),
        ), {"act": a["act"]})
        return self._restore(gm, out, _dtype(c.node))

    def _bf16_linear_act(self, gm, c):
        a, bf16 = c.info["args"], torch.bfloat16
        out = gu.call(gm, ttftc_ops.linear_act.default, (
            self._cast(gm, a["x"], bf16),
            self._const_like(gm, a["w"], bf16, f"{c.name}_w"),
            self._const_like(gm, a.get("b"), bf16, f"{c.name}_b"),
        ), {"act": a["act"]})
        return self._restore(gm, out, _dtype(c.node))

    def _bf16_norm_linear(self, gm, c):
        # The residual add stays fp32 (it is the residual stream); the norm statistics are fp32 inside the op.
        a, bf16 = c.info["args"], torch.bfloat16
        x = a["x"]
        if a.get("residual") is not None:
            x = gu.call(gm, aten.add.Tensor, (x, a["residual"]))
        out_dtype = _dtype(c.node.meta["val"][0] if isinstance(c.node.meta["val"], (list, tuple)) else c.node)
        new = gu.call(gm, ttftc_ops.norm_linear.default, (
            gu.call(gm, aten._to_copy.default, (x,), {"dtype": bf16}),
            self._const_like(gm, a["norm_w"], bf16, f"{c.name}_norm_w"),
            self._const_like(gm, a.get("norm_b"), bf16, f"{c.name}_norm_b"),
            self._const_like(gm, a["w"], bf16, f"{c.name}_w"),
            self._const_like(gm, a.get("b"), bf16, f"{c.name}_b"),
            None,
        ), {"kind": a["kind"], "eps": a["eps"]})
        out = self._restore(gm, gu.call(gm, operator.getitem, (new, 0)), out_dtype)
        _rewire_tuple(c.node, {0: out, 1: x if a.get("residual") is not None else None})
        return None

    def _bf16_attention(self, gm, c):
        # Same argument spelling as the original node (FLOP formulas bind them the way the pass wrote them).
        args = [self._cast(gm, a, torch.bfloat16) for a in c.node.args[:3]] + list(c.node.args[3:])
        out = gu.call(gm, ttftc_ops.attention.default, tuple(args), dict(c.node.kwargs))
        return self._restore(gm, out, _dtype(c.node))

    def _bf16_sdpa(self, gm, c):
        bf16 = torch.bfloat16
        args = list(c.node.args)
        args[:3] = [self._cast(gm, a, bf16) for a in args[:3]]
        kwargs = dict(c.node.kwargs)
        mask = kwargs.get("attn_mask")
        if mask is not None and _dtype(mask) in FLOATS:
            kwargs["attn_mask"] = self._cast(gm, mask, bf16)
        new = gu.call(gm, _SDPA_CPU, tuple(args), kwargs)
        out = self._restore(gm, gu.call(gm, operator.getitem, (new, 0)), _dtype(c.node.args[0]))
        _rewire_tuple(c.node, {0: out})
        return None

    def _bf16_bmm(self, gm, c):
        a, b = (self._cast(gm, n, torch.bfloat16) for n in c.node.args[:2])
        return self._restore(gm, gu.call(gm, aten.bmm.default, (a, b)), _dtype(c.node))

    # int8
    def _int8_linear(self, gm, c):
        wq, ws = self._int8_weight(gm, c.info["weight"], c.name)
        bias = c.info["bias_node"]
        if bias is not None and _dtype(bias) != torch.float32:
            bias = self._const_like(gm, bias, torch.float32, f"{c.name}_bias")
        return gu.call(gm, ttftc_ops.int8_linear.default, (c.info["x"], None, wq, ws, bias),
                       {"out_dtype": _dtype(c.node)})

    def _int8_linear_act(self, gm, c):
        a = c.info["args"]
        wq, ws = self._int8_weight(gm, gu.constant_value(gm, a["w"]), c.name)
        out = gu.call(gm, ttftc_ops.int8_linear.default,
                      (a["x"], None, wq, ws, self._const_like(gm, a.get("b"), torch.float32, f"{c.name}_b")),
                      {"out_dtype": _dtype(c.node)})
        target, kwargs = _ACT_NODES[a["act"]]
        return gu.call(gm, target, (out,), kwargs)

    def _int8_gated_ffn(self, gm, c):
        a = c.info["args"]
        gu_q, gu_s = self._int8_weight(gm, gu.constant_value(gm, a["w_gate_up"]), f"{c.name}_gate_up")
        d_q, d_s = self._int8_weight(gm, gu.constant_value(gm, a["w_down"]), f"{c.name}_down")
        fp32 = torch.float32
        return gu.call(gm, ttftc_ops.gated_ffn_int8.default, (
            a["x"], None, gu_q, gu_s, d_q, d_s,
            self._const_like(gm, a.get("b_gate_up"), fp32, f"{c.name}_b_gate_up"),
            self._const_like(gm, a.get("b_down"), fp32, f"{c.name}_b_down"),
        ), {"act": a["act"], "out_dtype": _dtype(c.node)})

    def _int8_norm_linear(self, gm, c):
        a = c.info["args"]
        out_val = c.node.meta["val"][0]
        nq = gu.call(gm, ttftc_ops.norm_quant.default,
                     (a["x"], a["norm_w"], a.get("norm_b"), a.get("residual")),
                     {"kind": a["kind"], "eps": a["eps"]})
        q, scale, residual = (gu.call(gm, operator.getitem, (nq, i)) for i in range(3))
        wq, ws = self._int8_weight(gm, gu.constant_value(gm, a["w"]), c.name)
        out = gu.call(gm, ttftc_ops.int8_linear.default,
                      (q, scale, wq, ws, self._const_like(gm, a.get("b"), torch.float32, f"{c.name}_b")),
                      {"out_dtype": out_val.dtype})
        _rewire_tuple(c.node, {0: out, 1: residual})
        return None

    def _int8_pt2e(self, gm, c):
        return _replace_existing_quant(gm, c.node, c.info)

    def _int8_int_mm(self, gm, c):
        return _replace_existing_quant(gm, c.node, c.info)


def _rewire_tuple(old: fx.Node, outputs: dict[int, Optional[fx.Node]]) -> None:
    """Point the getitem users of a tuple-returning node at replacement nodes; the old node then dies in DCE."""
    for index, users in _getitems(old).items():
        for user in users:
            replacement = outputs.get(index)
            if replacement is None:
                raise ValueError(f"output {index} of {old.name} is read but has no replacement")
            user.replace_all_uses_with(replacement)


def _graph_device(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.device.type
    return "cpu"


# -- cast round trips ---------------------------------------------------------------------------------------


def _is_cast(node: Any, dtype: torch.dtype) -> bool:
    return gu.is_call(node, aten._to_copy.default) and set(node.kwargs) == {"dtype"} and node.kwargs["dtype"] == dtype


def _reads_any_float(node: fx.Node, arg: fx.Node) -> bool:
    """Consumers for which a bf16 input is as good as the same values widened to fp32."""
    if _is_cast(node, torch.bfloat16):
        return True
    if gu.is_call(node, ttftc_ops.int8_linear.default, ttftc_ops.gated_ffn_int8.default):
        return node.args[0] is arg and node.args[1] is None
    return gu.is_call(node, ttftc_ops.quantize_per_token.default)


def _elide_round_trips(gm: fx.GraphModule) -> None:
    """bf16 → fp32 → (row views) → bf16 (or → an int8 quantiser) reads the bf16 tensor directly.

    Widening bf16 to fp32 is exact, so the round trip only costs two passes over memory; it appears where one
    bf16 op feeds another through views (attention → o_proj, the v projection → attention).
    """
    for widen in list(gm.graph.nodes):
        if not (_is_cast(widen, torch.float32) and _dtype(widen.args[0]) == torch.bfloat16):
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
                    if _is_cast(user, torch.bfloat16):
                        user.replace_all_uses_with(x)
                    else:
                        user.args = (x, *user.args[1:])


# -- producer fusion ---------------------------------------------------------------------------------------


def _int8_consumers_without_scale(gm: fx.GraphModule) -> dict[fx.Node, list[tuple[fx.Node, list[fx.Node]]]]:
    """Int8 GEMM nodes that still quantise their own input, grouped by the node that computes that input."""
    groups: dict[fx.Node, list[tuple[fx.Node, list[fx.Node]]]] = {}
    for node in gm.graph.nodes:
        if gu.is_call(node, ttftc_ops.int8_linear.default, ttftc_ops.gated_ffn_int8.default) and node.args[1] is None:
            root, chain = up_row_views(node.args[0])
            if isinstance(root, fx.Node) and _dtype(root) in FLOATS:
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


def _fuse_quant_producers(gm: fx.GraphModule) -> None:
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
            args = _kwargs_of(norm)
            with gm.graph.inserting_before(norm):
                nq = gu.call(gm, ttftc_ops.norm_quant.default,
                             (args["x"], args["norm_w"], args.get("norm_b"), args.get("residual")),
                             {"kind": args["kind"], "eps": args["eps"]})
                q, scale, residual = (gu.call(gm, operator.getitem, (nq, i)) for i in range(3))
            for user in _getitems(norm).get(1, []):
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


# -- quant-dequant patterns already in a graph ----------------------------------------------------------------

def _decomposed_ops():
    try:
        import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed ops)
    except Exception:
        return None
    return getattr(torch.ops, "quantized_decomposed", None)


def _is_zero(gm: fx.GraphModule, value: Any) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if value is None:
        return True
    tensor = gu.constant_value(gm, value)
    return tensor is not None and not bool(tensor.any())


def _match_pt2e_linear(gm: fx.GraphModule, node: fx.Node) -> Optional[dict]:
    """mm/addmm over dequantize(quantize(x)) and a dequantized frozen int8 weight (torch.ao PT2E output).

    Returns the pieces, with "refusal" set when the pattern is there but int8_linear cannot express it.
    """
    qd = _decomposed_ops()
    if qd is None:
        return None
    bias = node.args[0] if node.target is aten.addmm.default else None
    x, w = (node.args[1], node.args[2]) if bias is not None else (node.args[0], node.args[1])
    x_dq, x_chain = up_row_views(x)
    w_t = w
    w_dq = w_t.args[0] if gu.is_call(w_t, aten.t.default) else None
    act_dq = (qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor)
    if not (gu.is_call(x_dq, *act_dq) and isinstance(w_dq, fx.Node)):
        return None
    if not gu.is_call(w_dq, qd.dequantize_per_channel.default, qd.dequantize_per_tensor.default):
        return None
    x_q = x_dq.args[0]
    act_q = (qd.quantize_per_tensor.default, qd.quantize_per_tensor.tensor)
    found = {"x_dq": x_dq, "x_chain": x_chain, "w_dq": w_dq, "bias": bias, "x_q": x_q}
    if not gu.is_call(x_q, *act_q):
        found["refusal"] = "activation dequantize is not fed by a quantize_per_tensor"
        return found
    w_q = gu.constant_value(gm, w_dq.args[0])
    if w_q is None or w_q.dtype != torch.int8 or w_q.dim() != 2:
        found["refusal"] = "weight is not a frozen 2-D int8 tensor"
        return found
    if w_dq.target is qd.dequantize_per_channel.default:
        scales, zero_points, axis = gu.constant_value(gm, w_dq.args[1]), w_dq.args[2], w_dq.args[3]
        if scales is None or axis != 0:
            found["refusal"] = "weight scales are not frozen per output channel (axis 0)"
            return found
    else:
        scales, zero_points = w_dq.args[1], w_dq.args[2]
        if not isinstance(scales, float):
            found["refusal"] = "per-tensor weight scale is not a constant"
            return found
        scales = torch.full((w_q.shape[0],), scales)
    if not (_is_zero(gm, zero_points) and _is_zero(gm, x_dq.args[2]) and _is_zero(gm, x_q.args[2])):
        found["refusal"] = "asymmetric (non-zero zero point) quantisation: int8_linear is symmetric"
        return found
    if x_q.args[5] != torch.int8 or x_dq.args[1] is not x_q.args[1] and x_dq.args[1] != x_q.args[1]:
        found["refusal"] = "activation is not int8 with one scale for quantize and dequantize"
        return found
    if bias is not None and gu.constant_value(gm, bias) is None:
        found["refusal"] = "bias is not frozen"
        return found
    if gu.static_int(gu.val(x).shape[0]) is None:
        found["refusal"] = "the token count is symbolic; a per-tensor scale needs a static one to expand"
        return found
    found.update(w_q=w_q, w_scale=scales.float(), x_scale=x_q.args[1], x_root=x_q)
    return found


def _mul_factor(node: fx.Node, other: fx.Node) -> Optional[fx.Node]:
    if gu.is_call(node, aten.mul.Tensor) and len(node.args) == 2:
        a, b = node.args
        if a is other:
            return b
        if b is other:
            return a
    return None


def _int8_weight_operand(gm: fx.GraphModule, b: Any) -> Optional[Any]:
    """The [N, K] int8 weight behind _int_mm's B operand: a frozen tensor, or a live node (an unfrozen graph
    input, e.g. a torchao tensor subclass AOTAutograd desugared) under `aten.t`."""
    w = gu.transposed_constant(gm, b)
    if w is None and gu.constant_value(gm, b) is not None:
        w = gu.constant_value(gm, b).t()
    if w is not None:
        return w if w.dtype == torch.int8 and w.dim() == 2 else None
    if gu.is_call(b, aten.t.default) and _dtype(b.args[0]) == torch.int8 and gu.val(b.args[0]).dim() == 2:
        return b.args[0]
    return None


def _uint8_offset_source(a: Any) -> Optional[fx.Node]:
    """torchao on CPU feeds _int_mm u8 = (int32(x_q) + 128): the int8 x_q behind that, or None."""
    if not (_is_cast(a, torch.uint8) and gu.is_call(a.args[0], aten.add.Tensor) and a.args[0].args[1] == 128):
        return None
    widened = a.args[0].args[0]
    if _is_cast(widened, torch.int32) and _dtype(widened.args[0]) == torch.int8:
        return widened.args[0]
    return None


def _is_offset_correction(node: Any, mm: fx.Node, b: fx.Node) -> bool:
    """sub(mm, 128 · Σ_k B[k, :]): what undoes the +128 offset of the u8 activation."""
    if not (gu.is_call(node, aten.sub.Tensor) and node.args[0] is mm):
        return False
    times = node.args[1]
    if not (gu.is_call(times, aten.mul.Tensor) and times.args[1] == 128):
        return False
    total = times.args[0]
    return gu.is_call(total, aten.sum.dim_IntList) and total.args[0] is b and list(total.args[1]) == [0]


def _match_int_mm_chain(gm: fx.GraphModule, node: fx.Node):
    """torch._int_mm(x_q, W_q^T) → (cast) → · x_scale[M, 1] → · w_scale[N] (either order) → (+ bias[N]).

    Also torchao's CPU form, where x_q enters as uint8 x_q + 128 and a column-sum correction follows. Returns
    the pieces or a reason string.
    """
    a, b = node.args[:2]
    w_q = _int8_weight_operand(gm, b)
    if w_q is None:
        return "weight operand is not an int8 [N, K] matrix under t()"
    m, n = gu.val(node).shape
    if gu.static_int(m) is None:
        return "the token count is symbolic"
    x_root, current = a, node
    source = _uint8_offset_source(a)
    if source is not None:
        correction = gu.only_user(node)
        if correction is None or not _is_offset_correction(correction, node, b):
            return "uint8 activation without the matching offset correction"
        x_root, current = source, correction
    elif _dtype(a) != torch.int8:
        return f"activation operand is {_dtype(a)}, not int8"
    x_scale = w_scale = bias = None
    out_dtype = torch.float32
    for _ in range(5):
        user = gu.only_user(current)
        if user is None:
            break
        if _is_cast(user, _dtype(user)) and _dtype(user) in FLOATS and x_scale is None and w_scale is None:
            current, out_dtype = user, _dtype(user)
            continue
        if x_scale is not None and w_scale is not None and gu.is_call(user, aten.add.Tensor) and bias is None:
            other = user.args[1] if user.args[0] is current else user.args[0]
            if isinstance(other, fx.Node) and tuple(gu.val(other).shape) == (n,):
                bias, current, out_dtype = other, user, _dtype(user)
                continue
            break
        factor = _mul_factor(user, current)
        if factor is None or not isinstance(factor, fx.Node):
            break
        shape = tuple(gu.val(factor).shape)
        if shape == (m, 1) and x_scale is None:
            x_scale = factor
        elif shape in ((n,), (1, n)) and w_scale is None:
            w_scale = factor
        else:
            break
        current, out_dtype = user, _dtype(user)
    if x_scale is None or w_scale is None:
        return "no per-token activation scale and per-channel weight scale multiplies after it"
    if _dtype(current) not in FLOATS:
        return f"the chain ends in {_dtype(current)}, not a float"
    return {"x_root": x_root, "x_chain": [], "x_scale": x_scale, "w_q": w_q, "w_scale": w_scale, "bias": bias,
            "end": current, "out_dtype": out_dtype}


def _replace_existing_quant(gm: fx.GraphModule, node: fx.Node, info: dict) -> fx.Node:
    """Insert the ttftc.int8_linear for a recognised pattern (insertion point already set) and return it."""
    x = info["x_root"]
    for view in reversed(info["x_chain"]):
        x = gu.call(gm, view.target, (x, *view.args[1:]), dict(view.kwargs))
    tokens = gu.static_int(gu.val(x).shape[0])
    scale = info["x_scale"]
    if isinstance(scale, fx.Node):
        if tuple(gu.val(scale).shape) != (tokens,):
            scale = gu.call(gm, aten.expand.default, (gu.call(gm, aten.reshape.default, (scale, [-1])), [tokens]))
    else:
        scale = gu.call(gm, aten.full.default, ([tokens], float(scale)),
                        {"dtype": torch.float32, "device": gu.val(x).device})
    w_q, w_s = info["w_q"], info["w_scale"]
    # Frozen pieces become constants; live ones (unfrozen weights) are read where they are, reshaped to [N].
    w_q = gu.add_constant(gm, "quant_w_int8", w_q.contiguous()) if isinstance(w_q, torch.Tensor) else w_q
    if isinstance(w_s, torch.Tensor):
        w_s = gu.add_constant(gm, "quant_w_scale", w_s)
    else:
        w_s = gu.call(gm, aten.reshape.default, (w_s, [-1]))
        if _dtype(w_s) != torch.float32:
            w_s = gu.call(gm, aten._to_copy.default, (w_s,), {"dtype": torch.float32})
    bias = info.get("bias")
    out_dtype = info.get("out_dtype") or _dtype(node)
    if bias is not None and _dtype(bias) != torch.float32:
        frozen = gu.constant_value(gm, bias)
        bias = (gu.add_constant(gm, "quant_bias", frozen.float()) if frozen is not None
                else gu.call(gm, aten._to_copy.default, (bias,), {"dtype": torch.float32}))
    return gu.call(gm, ttftc_ops.int8_linear.default, (x, scale, w_q, w_s, bias), {"out_dtype": out_dtype})
