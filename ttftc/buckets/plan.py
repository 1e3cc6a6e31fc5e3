"""The bucketing plan: prove from the graph that right-padding a prompt cannot change its real positions.

This is an analysis, not a rewriting pass (one of ttftc.passes.registry.PIPELINE, selectable in Config.passes),
so it lives here; it shares only the attention pass's mask prover. It reads the functional aten graph of a trace
in which the sequence length is symbolic, so "which axis is the sequence" is a fact about sizes (a size whose
expression contains the sequence symbol), never a guess from a coincidence of numbers.

Padding is safe when, for every real position i, nothing computed at i reads a position j > i. Per-token
work (GEMMs over the hidden axis, norms over the hidden axis, pointwise math, views) keeps positions apart;
the only ops allowed to combine positions are attention ops shown to be causal:

- an SDPA op with is_causal=True, or with a mask that hides every key after its query;
- ttftc.attention with causal=True;
- a decomposed ("eager") attention: a softmax over keys whose scores were masked causally, and the GEMM of
  those probabilities with V.

A mask is shown causal by the attention pass's mask prover (ttftc.passes._attention_mask): it evaluates the
(data-independent) subgraph that builds the mask symbolically, for every sequence length, with the one threshold
for a masking value that holds for fp16, bf16 and fp32 masks, and no query may see a later key. Everything else
that reduces, pools, normalises, slices, shifts or gathers along the sequence axis, and every op this analysis
does not know, makes the plan refuse with a reason; the model then runs with dynamic shapes instead of buckets.

The graph is the model only at lengths that pass Dynamo's guards on the symbolic length (a slice past the
example length is traced away under one), so every bucket length must pass them too (length_guard_reason).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import sympy
import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from ttftc.ops.registry import op_name_of
from ttftc.passes._attention_mask import MaskEvaluator, Select, Unprovable, hides, prove_mask, same_size
from ttftc.fx_utils import bound_arguments, op_label

aten = torch.ops.aten

_VIEW_LIKE = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.clone.default, aten.alias.default, aten.detach.default,
    aten._to_copy.default, aten.lift_fresh_copy.default, aten.contiguous.default, aten._assert_tensor_metadata.default,
    aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.sym_storage_offset.default,
    aten.type_as.default, aten.repeat.default,
}

# Ops that create tensors from sizes alone: they read no positions.
_CONSTRUCTORS = {
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default, aten.ones.default,
    aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default, aten.new_zeros.default,
    aten.new_ones.default, aten.new_empty.default, aten.new_full.default, aten.zeros_like.default,
    aten.ones_like.default, aten.empty_like.default, aten.full_like.default, aten.empty_strided.default,
}

# Prefix scans are causal by construction: position i reads positions <= i.
_PREFIX_SCANS = {aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default}

# Reductions over their `dim` argument (an int, a list, or None for every dim).
_REDUCTIONS = {
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction,
    aten.prod.dim_int, aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default,
    aten.logsumexp.default, aten.any.dim, aten.any.dims, aten.all.dim, aten.linalg_vector_norm.default,
    aten.sort.default, aten.topk.default, aten.kthvalue.default, aten.median.dim, aten.mode.default,
}
_FULL_REDUCTIONS = {
    aten.sum.default, aten.mean.default, aten.max.default, aten.min.default, aten.prod.default, aten.any.default,
    aten.all.default, aten.var.default, aten.std.default, aten.median.default,
}
_SOFTMAXES = {aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int}

_SDPA = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten.scaled_dot_product_attention.default,
}

_INDEXING = {
    aten.gather.default, aten.index_select.default, aten.select.int, aten.unbind.int, aten.split.Tensor,
    aten.split_with_sizes.default, aten.index.Tensor,
}
# Ops whose problems are about attention: reported first, as they are the usual reason a model is not causal.
_ATTENTION_CLASS = _SDPA | _SOFTMAXES | {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}

# ttftc ops that work token by token (norms over the hidden axis, per-token activation scales).
_PER_TOKEN_TTFTC_OPS = {"gated_ffn", "linear_act", "linear", "norm_linear", "int8_linear", "rms_norm", "layer_norm"}


@dataclass(frozen=True)
class BucketPlan:
    """Whether a model may be padded to buckets, and the table it is padded to.

    safe:     padding proven safe; when False the model runs with dynamic shapes and `reason` says why.
    buckets:  the bucket table in effect (Config.buckets or the default, capped at the position limit).
    evidence: what the proof rests on (for explain).
    """

    safe: bool
    buckets: tuple[int, ...]
    reason: Optional[str] = None
    evidence: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.safe:
            head = f"bucketing: padding proven safe; buckets {list(self.buckets)}"
            body = "; ".join(self.evidence) if self.evidence else "no op mixes sequence positions"
            text = f"{head} ({body})"
        else:
            text = f"bucketing: refused, the graph stays dynamic: {self.reason}"
        return "; ".join([text, *self.notes])

    def to_dict(self) -> dict:
        return {
            "safe": self.safe, "buckets": list(self.buckets), "reason": self.reason,
            "evidence": list(self.evidence), "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "BucketPlan":
        return cls(
            safe=bool(data["safe"]), buckets=tuple(int(b) for b in data["buckets"]), reason=data.get("reason"),
            evidence=tuple(data.get("evidence", ())), notes=tuple(data.get("notes", ())),
        )


@dataclass
class _Findings:
    problems: list[str] = field(default_factory=list)
    evidence: dict[str, int] = field(default_factory=dict)

    def prove(self, what: str) -> None:
        self.evidence[what] = self.evidence.get(what, 0) + 1


class _Unanalysable(Exception):
    """A node the analysis cannot read; it refuses the plan, as any problem does."""


def _arguments(node: fx.Node) -> dict:
    """The node's arguments by schema name, defaults filled in."""
    args = bound_arguments(node)
    if args is None:
        raise _Unanalysable(f"{node.name}: its arguments do not bind to the schema of {op_label(node.target)}")
    return args


def _flat_nodes(arg: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(arg, out.append)
    return out


def _free_symbols(size: Any) -> set:
    if isinstance(size, torch.SymInt):
        return set(size.node.expr.free_symbols)
    return set()


class PaddingAnalysis:
    """Walks an aten graph whose sequence length is the sympy symbol(s) `seq_symbols`."""

    def __init__(self, gm: fx.GraphModule, seq_symbols: Iterable, max_length: int):
        self.gm = gm
        self.max_length = max_length
        self.seq = set(seq_symbols)
        self._masks = MaskEvaluator(gm)  # memoised: one mask shared by every layer is proven once
        self.findings = _Findings()
        self._data_dependent: dict[fx.Node, bool] = {}
        self._causal_probs: set[fx.Node] = set()
        self._attention_problem = False

    # -- shapes ----------------------------------------------------------------------------------------
    def seq_dims(self, node: Any) -> list[int]:
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not isinstance(value, torch.Tensor):
            return []
        return [d for d, size in enumerate(value.shape) if _free_symbols(size) & self.seq]

    def _has_seq(self, node: Any) -> bool:
        return bool(self.seq_dims(node))

    def _is_seq_size(self, size: Any) -> bool:
        return bool(_free_symbols(size) & self.seq)

    def _dim_size(self, node: fx.Node, dim: int) -> Any:
        return node.meta["val"].shape[dim]

    # -- data dependence -------------------------------------------------------------------------------
    def depends_on_data(self, node: fx.Node) -> bool:
        """True if the node's value depends on a tensor input (token ids, weights), not just on sizes."""
        if node in self._data_dependent:
            return self._data_dependent[node]
        stack = [node]
        while stack:  # iterative: graphs are deep enough to overflow recursion
            n = stack.pop()
            if n in self._data_dependent:
                continue
            pending = [a for a in n.all_input_nodes if a not in self._data_dependent]
            if pending:
                stack.append(n)
                stack.extend(pending)
                continue
            if n.op == "placeholder":
                result = isinstance(n.meta.get("val"), torch.Tensor)
            else:
                result = any(self._data_dependent[a] for a in n.all_input_nodes)
            self._data_dependent[n] = result
        return self._data_dependent[node]

    # -- masks -----------------------------------------------------------------------------------------
    def mask_is_causal(self, mask_node: Any, kind: str, scores_shape: tuple, scale: float = 1.0) -> Optional[str]:
        """None if the mask hides every later key from every query, at every sequence length, else why not.

        The attention pass's prover decides what the mask is; padding is safe only when no query sees a key
        after it (causal or a sliding window, aligned on the diagonal) over scores whose query and key axes are
        both the sequence.
        """
        if not isinstance(mask_node, fx.Node):
            return "the mask is not a tensor computed in the graph"
        if self.depends_on_data(mask_node):
            return f"the mask {mask_node.name} depends on graph inputs (e.g. an attention_mask), not only on positions"
        q_len, kv_len = scores_shape[-2], scores_shape[-1]
        if not (self._is_seq_size(q_len) and same_size(q_len, kv_len)):
            return f"the mask {mask_node.name} is not a [query, key] mask over the sequence"
        try:
            spec = prove_mask(self._masks, mask_node, scores_shape, kind=kind, scale=scale)
        except Unprovable as exc:
            return f"the mask {mask_node.name} is not proven causal ({exc})"
        if not spec.causal or spec.q_offset != 0:
            return f"the mask {mask_node.name} lets a query see later keys"
        return None

    # -- attention -------------------------------------------------------------------------------------
    def _check_sdpa(self, node: fx.Node) -> Optional[str]:
        normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        if normalized is None:
            return f"{node.name}: could not read the arguments of {op_label(node.target)}"
        kwargs = normalized.kwargs
        key = kwargs.get("key")
        if not self._has_seq(key):
            return None  # attends to a fixed-length memory: positions are not mixed
        mask = kwargs.get("attn_mask", kwargs.get("attn_bias"))
        if kwargs.get("is_causal"):
            if mask is not None:
                return f"{node.name}: is_causal together with a mask is not analysed"
            self.findings.prove("SDPA with is_causal=True")
            return None
        if mask is None:
            return f"{node.name}: bidirectional attention ({op_label(node.target)} with is_causal=False and no mask)"
        query = kwargs.get("query")
        scores_shape = (*query.meta["val"].shape[:-1], self._dim_size(key, -2))
        kind = "visible" if isinstance(mask, fx.Node) and mask.meta["val"].dtype == torch.bool else "additive"
        why = self.mask_is_causal(mask, kind, scores_shape)
        if why is not None:
            return f"{node.name}: attention mask not proven causal: {why}"
        self.findings.prove("SDPA with a causal mask (proven)")
        return None

    def _check_ttftc_attention(self, node: fx.Node) -> Optional[str]:
        if not node.kwargs.get("causal", False):
            return f"{node.name}: ttftc.attention with causal=False attends to later positions"
        self.findings.prove("ttftc.attention(causal=True)")
        return None

    def _masked_scores(self, node: fx.Node) -> Optional[str]:
        """For a softmax input: None if some step on its way from the scores applies a causal mask.

        A scale met on the way multiplies every mask applied before it, so a mask counts only if it still hides
        after that scale (-65504 halved no longer does).
        """
        reasons = []
        current, scale = node, 1.0
        while isinstance(current, fx.Node) and current.op == "call_function":
            target = current.target
            if target in (aten._to_copy.default, aten.clone.default, aten.alias.default, aten.view.default):
                current = current.args[0]  # casts keep a hidden key hidden (see MASKED_VALUE_LIMIT)
                continue
            if target in (aten.mul.Tensor, aten.div.Tensor):
                a, b = current.args[0], current.args[1]
                scores, factor = (b, a) if target is aten.mul.Tensor and not self._is_data(a) else (a, b)
                c = self._constant(factor)
                if c is None or not self._is_data(scores):
                    break
                if target is aten.div.Tensor:
                    if c == 0:
                        break
                    c = 1.0 / c
                scale *= c
                current = scores
                continue
            if target is aten.add.Tensor:
                a, b = current.args[0], current.args[1]
                scores, mask = (a, b) if self._is_data(a) else (b, a)
                alpha = current.kwargs.get("alpha", 1)
                why = self.mask_is_causal(mask, "additive", self._shape(current),
                                          scale * (alpha if mask is b else 1))
                if why is None:
                    return None
                reasons.append(why)
                current = scores
                continue
            if target is aten.where.self:
                cond, x, y = current.args
                if self._is_data(x) and self._fills_hidden(y, scale):
                    why = self.mask_is_causal(cond, "visible", self._shape(current))
                    scores = x
                elif self._is_data(y) and self._fills_hidden(x, scale):
                    why = self.mask_is_causal(cond, "hidden", self._shape(current))
                    scores = y
                else:
                    break
                if why is None:
                    return None
                reasons.append(why)
                current = scores
                continue
            if target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
                scores, cond, value = current.args
                if not self._fills_hidden(value, scale):
                    break
                why = self.mask_is_causal(cond, "hidden", self._shape(current))
                if why is None:
                    return None
                reasons.append(why)
                current = scores
                continue
            break
        return reasons[0] if reasons else "no causal mask is applied to the scores"

    def _is_data(self, x: Any) -> bool:
        return isinstance(x, fx.Node) and self.depends_on_data(x)

    @staticmethod
    def _shape(node: fx.Node) -> tuple:
        return tuple(node.meta["val"].shape)

    def _constant(self, x: Any) -> Optional[float]:
        """The number a scalar or a position-independent tensor holds everywhere, or None."""
        if isinstance(x, bool):
            return None
        if isinstance(x, (int, float)):
            return float(x)
        if not isinstance(x, fx.Node) or self.depends_on_data(x):
            return None
        try:
            value = self._masks.evaluate(x)
        except Unprovable:
            return None
        if isinstance(value, Select) and value.pred == ("const", True):
            return float(value.a)
        return None

    def _fills_hidden(self, value: Any, scale: float) -> bool:
        c = self._constant(value)
        return c is not None and hides(c * scale)

    def _check_softmax(self, node: fx.Node) -> Optional[str]:
        x = node.args[0]
        dim = node.args[1] % x.meta["val"].dim()
        if not self._is_seq_size(self._dim_size(x, dim)):
            return None
        if dim != x.meta["val"].dim() - 1:  # a mask's key axis is the last one, so only there does it mean causal
            return f"{node.name}: softmax over the sequence axis, which is not the scores' last (key) axis"
        why = self._masked_scores(x)
        if why is not None:
            return f"{node.name}: softmax over the sequence axis without a proven causal mask ({why})"
        self._causal_probs.add(node)
        self.findings.prove("softmax over causally masked scores (proven)")
        return None

    def _is_causal_probs(self, node: Any) -> bool:
        while isinstance(node, fx.Node) and node.op == "call_function":
            if node in self._causal_probs:
                return True
            if node.target in _VIEW_LIKE or node.target in (aten.native_dropout.default, aten.dropout.default):
                node = node.args[0]
            elif node.target is operator.getitem:
                node = node.args[0]
            else:
                return False
        return False

    # -- the other op classes --------------------------------------------------------------------------
    def _check_matmul(self, node: fx.Node) -> Optional[str]:
        target = node.target
        if target in (aten.addmm.default, aten.baddbmm.default):
            lhs, rhs = node.args[1], node.args[2]
        else:
            lhs, rhs = node.args[0], node.args[1]
        contraction = self._dim_size(lhs, -1)
        if not self._is_seq_size(contraction):
            return None
        if self._is_causal_probs(lhs):
            self.findings.prove("probabilities @ V over causal probabilities")
            return None
        return f"{node.name}: {op_label(target)} sums over the sequence axis outside a causal attention"

    def _check_reduction(self, node: fx.Node) -> Optional[str]:
        x = node.args[0]
        rank = x.meta["val"].dim()
        if node.target in _FULL_REDUCTIONS:
            dims = list(range(rank))
        else:
            dims = _arguments(node)["dim"]
            if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
                dims = list(range(rank))
            elif isinstance(dims, int):
                dims = [dims]
        for d in dims:
            if self._is_seq_size(self._dim_size(x, d % max(rank, 1))):
                return f"{node.name}: {op_label(node.target)} reduces across the sequence axis"
        return None

    def _check_layer_norm(self, node: fx.Node) -> Optional[str]:
        x, normalized_shape = node.args[0], node.args[1]
        rank = x.meta["val"].dim()
        for d in range(rank - len(normalized_shape), rank):
            if self._is_seq_size(self._dim_size(x, d)):
                return f"{node.name}: layer norm normalises across the sequence axis"
        return None

    def _check_slice(self, node: fx.Node) -> Optional[str]:
        args = _arguments(node)
        size = self._dim_size(args["input"], args["dim"])
        if not self._is_seq_size(size):
            return None
        start, end, step = args["start"], args["end"], args["step"]
        # A slice is a no-op, whatever the padded length up to the largest bucket, when it starts at 0 (or
        # counts back at least that far, like a sliding-window cache keeping its last W-1 keys) and ends at
        # the end.
        full_start = start in (0, None) or (isinstance(start, int) and start < 0 and -start >= self.max_length)
        end_value = end.meta.get("val") if isinstance(end, fx.Node) else end  # narrow(x, dim, 0, x.size(dim))
        full_end = end is None or (isinstance(end, int) and end >= self.max_length) or str(end_value) == str(size)
        if full_start and full_end and step == 1:
            return None
        return f"{node.name}: slices the sequence axis ({start}:{end}:{step}), so positions would shift with padding"

    def _indexes_seq(self, x: fx.Node, dims: Iterable[int]) -> bool:
        rank = x.meta["val"].dim()
        return any(self._is_seq_size(self._dim_size(x, d % rank)) for d in dims)

    def _check_indexing(self, node: fx.Node) -> Optional[str]:
        """Gathers, selects and splits are position-wise unless the axis they index is the sequence axis."""
        args = _arguments(node)
        if node.target is aten.index.Tensor:  # one optional index tensor per leading dim
            dims = [d for d, index in enumerate(args["indices"]) if index is not None]
        else:  # gather, index_select, select, unbind, split, split_with_sizes
            dims = [args["dim"]]
        if self._indexes_seq(args["input"], dims):
            return f"{node.name}: {op_label(node.target)} picks positions along the sequence axis"
        return None

    def _check_cat(self, node: fx.Node) -> Optional[str]:
        args = _arguments(node)
        tensors, dim = args["tensors"], args["dim"]
        rank = node.meta["val"].dim()
        if not self._is_seq_size(node.meta["val"].shape[dim % rank]):
            return None
        # A zero-element piece (e.g. the legacy 1-D empty tensor of a fresh KV cache) adds no positions.
        non_empty = [t for t in tensors if not (isinstance(t.meta["val"].numel(), int) and t.meta["val"].numel() == 0)]
        if len(non_empty) <= 1:
            return None  # e.g. a fresh KV cache: an empty past concatenated with the new keys
        return f"{node.name}: concatenates along the sequence axis"

    def _check_node(self, node: fx.Node) -> Optional[str]:
        target = node.target
        inputs = _flat_nodes((node.args, node.kwargs))
        if not any(self._has_seq(a) for a in inputs):
            return None  # reads no sequence-shaped tensor: weights, sizes, or constructors
        if target is operator.getitem or target in _VIEW_LIKE or target in _CONSTRUCTORS or target in _PREFIX_SCANS:
            return None
        ttftc_op = op_name_of(target)
        if ttftc_op == "attention":
            return self._check_ttftc_attention(node)
        if ttftc_op in _PER_TOKEN_TTFTC_OPS:
            return None
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
            return None
        if target in (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default):
            return self._check_matmul(node)
        if target in _SDPA:
            return self._check_sdpa(node)
        if target in _SOFTMAXES:
            return self._check_softmax(node)
        if target in _REDUCTIONS or target in _FULL_REDUCTIONS:
            return self._check_reduction(node)
        if target is aten.native_layer_norm.default:
            return self._check_layer_norm(node)
        if target is aten.slice.Tensor:
            return self._check_slice(node)
        if target is aten.cat.default:
            return self._check_cat(node)
        if target in _INDEXING:
            return self._check_indexing(node)
        if target is aten.embedding.default:
            return None if not self._has_seq(node.args[0]) else f"{node.name}: embedding table indexed by position"
        return f"{node.name}: cannot prove {op_label(target)} keeps sequence positions independent"

    def run(self) -> tuple[Optional[str], tuple[str, ...]]:
        """(None, evidence) when padding is proven safe, else (the first problem, evidence so far)."""
        if not self.seq:
            return "the sequence length was specialised during tracing, so the sequence axis is unknown", ()
        for node in self.gm.graph.nodes:
            if node.op != "call_function":
                continue
            try:
                problem = self._check_node(node)
            except _Unanalysable as unanalysable:
                problem = str(unanalysable)
            if problem is not None:
                about_attention = node.target in _ATTENTION_CLASS or op_name_of(node.target) == "attention"
                if about_attention and not self._attention_problem:
                    self.findings.problems.insert(0, problem)
                    self._attention_problem = True
                else:
                    self.findings.problems.append(problem)
        evidence = tuple(f"{n}x {what}" for what, n in self.findings.evidence.items())
        if self.findings.problems:
            extra = len(self.findings.problems) - 1
            more = f" (+{extra} more)" if extra else ""
            return self.findings.problems[0] + more, evidence
        return None, evidence


def _shape_env(gm: fx.GraphModule):
    """The ShapeEnv of the trace's symbolic sizes (one for the whole graph), or None if no input is symbolic."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        for size in value.shape if isinstance(value, torch.Tensor) else (value,):
            if isinstance(size, torch.SymInt):
                return size.node.shape_env
    return None


def length_guard_reason(gm: fx.GraphModule, seq_symbols: Iterable, buckets: tuple[int, ...]) -> Optional[str]:
    """Why the trace is not the model at every bucket length, or None.

    Dynamo traces at one example length and keeps a branch or drops a slice under a guard on it (x[:, :10]
    traced at length 8 guards `s < 10` and has no slice left), so the graph says nothing about lengths that
    fail a guard."""
    shape_env = _shape_env(gm)
    if shape_env is None:
        return None
    # Sizes Dynamo unified (position_ids' length with input_ids') read as one symbol, on both sides.
    seq = set()
    for symbol in seq_symbols:
        canonical = shape_env.replace(symbol)
        if not isinstance(canonical, sympy.Symbol):
            return f"Dynamo rewrote the sequence length {symbol} as {canonical}"
        seq.add(canonical)
    for symbol in sorted(seq, key=str):  # sympy symbols do not order themselves
        bounds = shape_env.var_to_range.get(symbol)
        for length in buckets:
            if bounds is not None and not bounds.lower <= length <= bounds.upper:
                return f"the trace holds only for sequence lengths in [{bounds.lower}, {bounds.upper}], " \
                       f"and bucket {length} is not"
    for guard in shape_env.guards:
        condition = shape_env.replace(guard.expr)
        if not condition.free_symbols & seq:
            continue
        for length in buckets:
            # Other sizes keep their traced values; a symbol with none (data-dependent) leaves the guard unproven.
            held = condition.xreplace({s: sympy.Integer(length) for s in seq}).xreplace(shape_env.backed_var_to_val)
            if held is not sympy.true:
                return f"the trace holds only for sequence lengths where {guard.expr} (Dynamo guarded on it), " \
                       f"and bucket {length} does not"
    return None


def plan_from_graph(
    gm: fx.GraphModule, seq_symbols: Iterable, buckets: tuple[int, ...], notes: Sequence[str] = ()
) -> BucketPlan:
    """Analyse `gm` (pre-pass aten graph with a symbolic sequence length) into a BucketPlan."""
    seq_symbols = set(seq_symbols)
    problem, evidence = PaddingAnalysis(gm, seq_symbols, max(buckets)).run()
    problem = problem or length_guard_reason(gm, seq_symbols, buckets)
    return BucketPlan(safe=problem is None, buckets=buckets, reason=problem, evidence=evidence, notes=tuple(notes))


def refused(buckets: tuple[int, ...], reason: str, notes: Sequence[str] = ()) -> BucketPlan:
    return BucketPlan(safe=False, buckets=buckets, reason=reason, notes=tuple(notes))


