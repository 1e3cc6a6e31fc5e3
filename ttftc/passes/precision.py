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

Quant-dequant patterns already in the graph (torch.ao PT2E, torchao's `_int_mm` chains) are fused into
ttftc.int8_linear in the bf16 and int8 modes (_quant_patterns.py).

This module is the policy: which candidate gets which precision, and why not. The rewrites live by concept in
_bf16_rewrite.py and _w8a8_rewrite.py, the names of layers in _module_names.py.

A Config.quant_skip fragment matches when it is contained in one of the names a node computes for
(_module_names.py) or equals the op kind ("gated_ffn", "norm_linear", "linear").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.fx as fx

from ttftc.capabilities import Capabilities, measured_bf16_speedup, probe
from ttftc.codegen.npu import _torch_npu
from ttftc.passes import _bf16_rewrite, _w8a8_rewrite
from ttftc import fx_utils as gu
from ttftc.passes._linear import match_linear
from ttftc.passes._module_names import describe, node_module_names
from ttftc.passes._precision_common import FLOATS, Casts
from ttftc.passes._quant_patterns import match_int_mm_chain, match_pt2e_linear, replace_existing_quant
from ttftc.passes.base import GraphPass

aten = torch.ops.aten
ttftc_ops = torch.ops.ttftc

# Input dtypes the bf16 policy lowers (bf16 models are already there; fp16 keeps its own numerics).
WIDE_FLOATS = (torch.float32,)
# The int8 kernels (Triton tiles, torch._int_mm on CUDA, npu_quant_matmul) want both GEMM dimensions in whole
# multiples of 8 and a reduction of at least 16; every transformer width is, so a refusal flags an odd layer.
INT8_ALIGN = 8
INT8_MIN_K = 16

_SDPA_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
_ATTENTION_KINDS = ("attention", "sdpa", "bmm")


def int8_unavailable_reason(device_type: str) -> Optional[str]:
    """None when `device_type` has an int8 GEMM path ttftc can lower to, else why not."""
    if device_type in ("cpu", "cuda"):
        return None if hasattr(torch, "_int_mm") else "this torch has no torch._int_mm"
    if device_type == "npu":
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


# -- matches -----------------------------------------------------------------------------------------------


@dataclass
class Candidate:
    kind: str  # linear | norm_linear | gated_ffn | linear_act | attention | sdpa | bmm | pt2e | int_mm
    node: fx.Node
    name: str  # for explain: the module path(s), see `describe`
    plan: str = ""  # "int8" or "bf16", decided by guard
    info: dict = field(default_factory=dict)


class PrecisionPass(GraphPass):
    name = "precision"

    def options(self) -> dict:
        options = {
            "precision": self.config.precision,
            "quant_skip": list(self.config.quant_skip),
            "int8_align": INT8_ALIGN,
            "int8_min_k": INT8_MIN_K,
        }
        if self.config.precision in ("auto", "int8"):  # what these emit depends on the machine
            device = self.config.device if self.config.device != "auto" else _default_device()
            caps = probe(device)
            options["native_bf16"], options["bf16_attention"] = caps.native_bf16, caps.bf16_attention
        return options

    # -- driver additions ------------------------------------------------------------------------------------
    def run(self, gm: fx.GraphModule):
        self._casts = Casts()
        self.mode, self.float_policy = self._effective_policy(gm)
        stats = super().run(gm)
        if self.mode in ("bf16", "int8"):
            _bf16_rewrite.elide_round_trips(gm)
            if self.mode == "int8":
                _w8a8_rewrite.fuse_quant_producers(gm)
            gm.graph.eliminate_dead_code()
            gm.graph.lint()
            gm.recompile()
        return stats

    def _effective_policy(self, gm: fx.GraphModule) -> tuple[str, dict[str, str]]:
        """(mode, float policy): the mode is fp32, bf16 or int8; the float policy gives, per op class ("gemm",
        "attention"), the precision of what int8 does not take: bf16 only where the device computes it natively
        and, for attention, where its bf16 kernel is measured faster (ttftc.capabilities)."""
        precision = self.config.precision
        device = _graph_device(gm)
        caps = probe(device)
        if precision == "bf16":
            if not caps.native_bf16:
                _warn_emulated_bf16(caps)
                self.stats.decisions.append(f"precision 'bf16' as asked, although bf16 is not native on {caps.name}")
            return "bf16", {"gemm": "bf16", "attention": "bf16"}
        if precision == "fp32":
            return "fp32", {"gemm": "fp32", "attention": "fp32"}
        policy = {"gemm": "bf16" if caps.native_bf16 else "fp32",
                  "attention": "bf16" if caps.bf16_attention else "fp32"}
        why = (f"on {caps.name} bf16 is {'native' if caps.native_bf16 else 'not native'} ({caps.bf16_evidence})"
               + ("" if caps.bf16_attention_speedup is None
                  else f", and the bf16 attention kernel measured {caps.bf16_attention_speedup:.2f}x fp32"))
        if precision == "auto":
            self.stats.decisions.append(f"precision 'auto' chose {policy['gemm']} GEMMs and {policy['attention']} "
                                        f"attention: {why}; auto never quantises to int8")
            return ("bf16" if "bf16" in policy.values() else "fp32"), policy
        reason = int8_unavailable_reason(device)
        if reason is not None:
            message = (f"precision='int8' has no int8 path on device {device!r} ({reason}); falling back to "
                       f"{policy['gemm']}")
            warnings.warn(f"ttftc: {message}", RuntimeWarning, stacklevel=2)
            self.stats.reject(message)
            return ("bf16" if "bf16" in policy.values() else "fp32"), policy
        self.stats.decisions.append(f"precision 'int8': W8A8 linears; the GEMMs kept out of int8 run "
                                    f"{policy['gemm']}, attention {policy['attention']}: {why}")
        return "int8", policy

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
            pattern = match_pt2e_linear(gm, node)
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
        kept = self.float_policy["attention" if c.kind in _ATTENTION_KINDS else "gemm"]
        if kept != "bf16":
            if int8_reason is not None:
                self.stats.reject(f"{c.name}: int8 refused: {int8_reason}; kept {kept}")
            return f"{c.name}: kept {kept}: bf16 is not the faster precision for it on this device"
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
        args = gu.bound_arguments(c.node)
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
        if gu.dtype_of(x) not in FLOATS:
            return f"activation dtype {gu.dtype_of(x)} is not floating point"
        if c.kind == "norm_linear" and c.info["args"].get("kind") not in ("rms", "layer"):
            return f"norm kind {c.info['args'].get('kind')!r}"
        return None

    def _bf16_refusal(self, gm: fx.GraphModule, c: Candidate) -> Optional[str]:
        if c.kind in ("linear", "norm_linear", "gated_ffn", "linear_act"):
            # Matched again, not read from c.info: an int8 refusal leaves its partial match there.
            if self._weights(gm, c) is None:
                return "weights are not frozen constants"
            x = c.info["x"] if c.kind == "linear" else c.info["args"]["x"]
            return None if gu.dtype_of(x) in WIDE_FLOATS else f"activation dtype {gu.dtype_of(x)} (only fp32 is lowered)"
        if c.kind == "attention":
            if len(c.node.args) < 3:
                return "q, k, v are not positional"
            q = c.node.args[0]
            return None if gu.dtype_of(q) in WIDE_FLOATS else f"query dtype {gu.dtype_of(q)}"
        if c.kind == "sdpa":
            items = gu.getitem_users(c.node)
            if set(items) - {0} or len(items.get(0, [])) == 0:
                return "the logsumexp output is read"
            mask = c.node.kwargs.get("attn_mask")
            if mask is not None and gu.dtype_of(mask) not in (torch.bool,) + FLOATS:
                return f"mask dtype {gu.dtype_of(mask)}"
            return None if gu.dtype_of(c.node.args[0]) in WIDE_FLOATS else f"query dtype {gu.dtype_of(c.node.args[0])}"
        if c.kind == "bmm":
            a, b = c.node.args[:2]
            if gu.constant_value(gm, a) is not None or gu.constant_value(gm, b) is not None:
                return "bmm with a frozen operand"
            return None if gu.dtype_of(a) in WIDE_FLOATS and gu.dtype_of(b) in WIDE_FLOATS else f"dtype {gu.dtype_of(a)}"
        return f"unknown candidate kind {c.kind}"

    def _guard_existing_quant(self, gm: fx.GraphModule, c: Candidate) -> Optional[str]:
        if c.kind == "int_mm":
            pattern = match_int_mm_chain(gm, c.node)
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
        handler = _REWRITES[c.plan][c.kind]
        # A torchao chain is replaced at its last multiply: its scale operands may be computed after the _int_mm.
        anchor = c.info["end"] if c.kind == "int_mm" else c.node
        with gm.graph.inserting_before(anchor):
            new = handler(self._casts, gm, c)
        if new is not None:
            anchor.replace_all_uses_with(new)  # the replaced nodes die in the driver's dead-code elimination


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _warn_emulated_bf16(caps: Capabilities) -> None:
    speedup = measured_bf16_speedup()
    warnings.warn(
        f"ttftc: precision='bf16' on {caps.name}, which has no native bf16 ({caps.bf16_evidence}): bf16 GEMMs "
        f"are emulated here and measured {1 / speedup:.1f}x the time of fp32 ones. precision='auto' picks the "
        "fastest precision this device computes natively.", RuntimeWarning, stacklevel=3)


def _graph_device(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.device.type
    return "cpu"


def _existing_quant(casts: Casts, gm: fx.GraphModule, c: Candidate) -> fx.Node:
    return replace_existing_quant(gm, c.node, c.info)


# plan -> candidate kind -> rewrite(casts, gm, candidate), called with the insertion point set.
_REWRITES = {
    "bf16": _bf16_rewrite.REWRITES,
    "int8": {**_w8a8_rewrite.REWRITES, "pt2e": _existing_quant, "int_mm": _existing_quant},
}
