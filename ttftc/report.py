"""What one compile did: pass matches and rejections, op histograms, lowering choices, FLOPs.

`ttftc.explain` returns a Report; the backend also keeps one per compiled graph in `TtftcBackend.reports`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from ttftc.ops.registry import get_op, op_name_of

aten = torch.ops.aten


def _hint(x: Any) -> int:
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else int(x.node.shape_env.size_hint(x.node.expr))
    return int(x)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= _hint(s)
    return n


def _concrete(arg: Any) -> Any:
    """Meta value with symbolic ints replaced by their hints, so FLOP formulas can do arithmetic."""
    if isinstance(arg, fx.Node):
        arg = arg.meta.get("val")
    if isinstance(arg, torch.SymInt):
        return _hint(arg)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_concrete(a) for a in arg)
    return arg


class _ShapeOnly:
    """A stand-in with concrete .shape, .dim() and .numel() for FLOP formulas."""

    def __init__(self, t: torch.Tensor):
        self.shape = torch.Size(_hint(s) for s in t.shape)
        self.dtype = t.dtype

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return _numel(self.shape)


def _shapes(arg: Any) -> Any:
    arg = _concrete(arg)
    if isinstance(arg, torch.Tensor):
        return _ShapeOnly(arg)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_shapes(a) for a in arg)
    if isinstance(arg, dict):
        return {k: _shapes(v) for k, v in arg.items()}
    return arg


def node_flops(node: fx.Node) -> int:
    """FLOPs of the GEMM-class work in one node (2 per multiply-add); 0 for everything else."""
    if node.op != "call_function":
        return 0
    op = op_name_of(node.target) or node.meta.get("ttftc_op")
    if op is not None:
        return int(get_op(op).flops(*_shapes(node.args), **_shapes(node.kwargs)))
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor) else None
    if out is None:
        return 0
    if node.target in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default):
        a = node.args[1] if node.target in (aten.addmm.default, aten.baddbmm.default) else node.args[0]
        k = _hint(a.meta["val"].shape[-1])
        return 2 * _numel(out.shape) * k
    if node.target in (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten.scaled_dot_product_attention.default,
    ):
        q, k = (a.meta["val"] for a in node.args[:2])
        return 4 * _numel(q.shape[:-1]) * _hint(k.shape[-2]) * _hint(q.shape[-1])
    return 0


def graph_flops(gm: fx.GraphModule) -> int:
    return sum(node_flops(n) for n in gm.graph.nodes)


@dataclass
class Report:
    pass_counts: dict[str, int] = field(default_factory=dict)
    candidates: dict[str, int] = field(default_factory=dict)
    rejections: dict[str, list[str]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    ops_before: dict[str, int] = field(default_factory=dict)
    ops_after: dict[str, int] = field(default_factory=dict)
    # op -> provider -> how many nodes of that op went to that provider
    providers: dict[str, dict[str, int]] = field(default_factory=dict)
    # "node (op): provider: reason" for every provider passed over
    fallbacks: list[str] = field(default_factory=list)
    flops: int = 0
    graphs: int = 0
    pass_uuids: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def merge(self, other: "Report") -> None:
        """Fold another graph's report into this one (a model with graph breaks compiles several graphs)."""
        for name, n in other.pass_counts.items():
            self.pass_counts[name] = self.pass_counts.get(name, 0) + n
        for name, n in other.candidates.items():
            self.candidates[name] = self.candidates.get(name, 0) + n
        for name, reasons in other.rejections.items():
            self.rejections.setdefault(name, []).extend(reasons)
        self.errors.update(other.errors)
        for hist_self, hist_other in ((self.ops_before, other.ops_before), (self.ops_after, other.ops_after)):
            for op, n in hist_other.items():
                hist_self[op] = hist_self.get(op, 0) + n
        for op, by_provider in other.providers.items():
            mine = self.providers.setdefault(op, {})
            for provider, n in by_provider.items():
                mine[provider] = mine.get(provider, 0) + n
        self.fallbacks.extend(other.fallbacks)
        self.flops += other.flops
        self.graphs += other.graphs
        self.pass_uuids.update(other.pass_uuids)
        self.notes.extend(other.notes)

    def __str__(self) -> str:
        lines = [f"ttftc explain: {self.graphs} graph(s), {self.flops / 1e9:.3f} GFLOP per call"]
        lines.append("")
        lines.append(f"{'pass':<14}{'matched':>8}{'rejected':>10}  first rejection reason")
        for name, n in self.pass_counts.items():
            reasons = self.rejections.get(name, [])
            if name in self.errors:
                first = "ERROR: " + self.errors[name]
            elif reasons:
                first = reasons[0]
            elif self.candidates.get(name, 0) == 0:
                first = "no candidate in the graph: nothing this pass knows"
            else:
                first = ""
            lines.append(f"{name:<14}{n:>8}{len(reasons):>10}  {_clip(first, 70)}")
        if not self.pass_counts:
            lines.append("(no passes enabled)")
        ttftc_ops = {op: n for op, n in self.ops_after.items() if op.startswith("ttftc.")}
        lines.append("")
        lines.append(f"{'op':<48}{'before':>8}{'after':>8}")
        interesting = sorted(
            {op for op in list(self.ops_before) + list(self.ops_after) if _is_interesting(op)},
            key=lambda op: (not op.startswith("ttftc."), op),
        )
        for op in interesting:
            lines.append(f"{op:<48}{self.ops_before.get(op, 0):>8}{self.ops_after.get(op, 0):>8}")
        lines.append(f"{'(all ops)':<48}{sum(self.ops_before.values()):>8}{sum(self.ops_after.values()):>8}")
        if ttftc_ops:
            lines.append("")
            lines.append("lowering:")
            for op, by_provider in sorted(self.providers.items()):
                chosen = ", ".join(f"{p} x{n}" for p, n in sorted(by_provider.items()))
                lines.append(f"  ttftc.{op}: {chosen}")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def _is_interesting(op: str) -> bool:
    return op.startswith("ttftc.") or op.split(".")[-1] in {
        "mm", "addmm", "bmm", "baddbmm", "_softmax", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention", "rsqrt",
        "native_layer_norm", "silu", "gelu", "_int_mm",
    }


def _clip(text: str, width: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def providers_histogram(decisions) -> tuple[dict[str, dict[str, int]], list[str]]:
    providers: dict[str, dict[str, int]] = {}
    fallbacks = []
    for d in decisions:
        by_provider = providers.setdefault(d.op, {})
        by_provider[d.provider] = by_provider.get(d.provider, 0) + 1
        fallbacks.extend(f"{d.node} ({d.op}) {s}" for s in d.skipped)
    return providers, fallbacks


def make_report(
    stats, ops_before, ops_after, decisions, flops: int, pass_uuids: dict[str, str], notes: Optional[list] = None
) -> Report:
    providers, fallbacks = providers_histogram(decisions)
    return Report(
        pass_counts={s.name: s.matched for s in stats},
        candidates={s.name: s.candidates for s in stats},
        rejections={s.name: list(s.rejections) for s in stats},
        errors={s.name: s.error for s in stats if s.error},
        ops_before=ops_before,
        ops_after=ops_after,
        providers=providers,
        fallbacks=fallbacks,
        flops=flops,
        graphs=1,
        pass_uuids=pass_uuids,
        notes=list(notes or []) + [f"{s.name}: {d}" for s in stats for d in s.decisions],
    )
