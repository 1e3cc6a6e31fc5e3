"""Predict a prefill's TTFT on a device that is not here, from the compiled graph and the device's published peaks.

Per node of ttftc's lowered graph:
    FLOPs   the GEMM-class work (ttftc.report.node_flops: 2 per multiply-add; attention counts its causal pairs)
    bytes   every tensor the node reads or writes, moved once (weights included; views move nothing; a gather
            such as the embedding reads only the rows it returns)
    bound   max(FLOPs / peak FLOP/s for the node's compute dtype, bytes / memory bandwidth)
The predicted TTFT is the sum of the node bounds: a roofline lower bound that assumes every kernel runs at the
device's peak and that nothing overlaps. It ignores launch overheads (a few microseconds per kernel, which matter
for short prompts), tiles re-read from cache, and the host side (tokenisation, Python, the lm_head's transfer).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.fx as fx

from ttftc.bench.devices import DeviceSpec
from ttftc.ops.registry import op_name_of
from ttftc.report import node_flops

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "int8"}
# Aliasing ops that torch does not tag as views but that move no data inside a compiled graph.
_METADATA_ONLY = {operator.getitem, torch.ops.aten._unsafe_view.default, torch.ops.aten.lift_fresh_copy.default}
# Gathers read only the rows they output, not their whole source (an embedding table is mostly untouched).
_GATHER_SOURCE_ARG = {torch.ops.aten.embedding.default: 0, torch.ops.aten.index_select.default: 0,
                      torch.ops.aten.gather.default: 0}


@dataclass(frozen=True)
class NodeBound:
    node: str
    op: str  # "ttftc.attention", "aten.mm", ...
    dtype: str  # the compute dtype whose peak bounds the FLOPs
    flops: int
    bytes: int
    compute_s: float
    memory_s: float

    @property
    def bound_s(self) -> float:
        return max(self.compute_s, self.memory_s)


@dataclass(frozen=True)
class OpSummary:
    op: str
    count: int
    flops: int
    bytes: int
    bound_s: float
    compute_bound: int  # how many of its nodes are limited by FLOP/s rather than bandwidth


@dataclass
class Prediction:
    device: DeviceSpec
    nodes: list[NodeBound]
    notes: list[str] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return sum(n.bound_s for n in self.nodes)

    @property
    def flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    @property
    def bytes(self) -> int:
        return sum(n.bytes for n in self.nodes)

    def by_op(self) -> list[OpSummary]:
        """Nodes summed per op, the slowest first."""
        groups: dict[str, list[NodeBound]] = {}
        for n in self.nodes:
            groups.setdefault(n.op, []).append(n)
        summaries = [OpSummary(op, len(ns), sum(n.flops for n in ns), sum(n.bytes for n in ns),
                               sum(n.bound_s for n in ns), sum(n.compute_s >= n.memory_s for n in ns))
                     for op, ns in groups.items()]
        return sorted(summaries, key=lambda s: -s.bound_s)


def _tensors(value) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _size(s) -> int:
    # A graph compiled with dynamic shapes holds SymInts: their hint is the size this compile saw.
    if isinstance(s, torch.SymInt) and s.node.hint is not None:
        return int(s.node.hint)
    return int(s)


def _nbytes(t: torch.Tensor) -> int:
    count = 1
    for s in t.shape:
        count *= _size(s)
    return count * t.element_size()


def _moves_no_data(node: fx.Node) -> bool:
    return node.target in _METADATA_ONLY or bool(getattr(node.target, "is_view", False))


def _op_label(node: fx.Node) -> str:
    op = op_name_of(node.target) or node.meta.get("ttftc_op")
    if op:
        return f"ttftc.{op}"
    name = getattr(node.target, "__name__", str(node.target))
    overload = getattr(node.target, "_overloadpacket", None)
    return f"aten.{overload.__name__}" if overload is not None else name


def _inputs(node: fx.Node) -> list[torch.Tensor]:
    seen, tensors = set(), []
    for arg in node.all_input_nodes:
        if arg in seen:
            continue
        seen.add(arg)
        tensors.extend(_tensors(arg.meta.get("val")))
    return tensors


def _bytes_moved(node: fx.Node, inputs: list[torch.Tensor]) -> int:
    outputs = sum(_nbytes(t) for t in _tensors(node.meta.get("val")))
    source = _GATHER_SOURCE_ARG.get(node.target)
    if source is not None and isinstance(node.args[source], fx.Node):
        skipped = sum(_nbytes(t) for t in _tensors(node.args[source].meta.get("val")))
        return sum(_nbytes(t) for t in inputs) - skipped + 2 * outputs  # the gathered rows in, the result out
    return sum(_nbytes(t) for t in inputs) + outputs


def _compute_dtype(inputs: list[torch.Tensor]) -> str:
    """int8 when the node multiplies int8 operands; else the dtype of its first floating-point input."""
    if any(t.dtype == torch.int8 for t in inputs):
        return "int8"
    floating = next((t.dtype for t in inputs if t.dtype.is_floating_point), torch.float32)
    return _DTYPE_NAMES.get(floating, "fp32")


def predict(graphs: Iterable[fx.GraphModule], device: DeviceSpec) -> Prediction:
    nodes, notes = [], []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function" or _moves_no_data(node):
                continue
            inputs = _inputs(node)
            moved = _bytes_moved(node, inputs)
            flops = node_flops(node)
            dtype = _compute_dtype(inputs)
            peak, note = device.peak_flops(dtype)
            if note and flops and note not in notes:
                notes.append(note)
            nodes.append(NodeBound(node.name, _op_label(node), dtype, flops, moved, flops / peak,
                                   moved / device.bandwidth_bytes_s))
    if device.approximate:
        notes.append(f"{device.name}'s figures are approximate (see ttftc/bench/devices.json)")
    return Prediction(device, nodes, notes)


def format_prediction(prediction: Prediction, top: Optional[int] = 12) -> str:
    d = prediction.device
    peaks = ", ".join(f"{k} {v:g}" for k, v in d.peak_tflops.items())
    lines = [f"prediction for {d.name}: peaks (dense, TFLOP/s or TOP/s) {peaks}; memory {d.bandwidth_gb_s:g} GB/s",
             f"  source: {d.source}",
             f"  {'op':<34}{'nodes':>6}{'GFLOP':>10}{'MB moved':>11}{'bound ms':>10}  limited by"]
    summaries = prediction.by_op()
    for s in summaries[:top] if top else summaries:
        limit = ("compute" if s.compute_bound == s.count else "memory" if s.compute_bound == 0
                 else f"compute {s.compute_bound}/{s.count}")
        lines.append(f"  {s.op:<34}{s.count:>6}{s.flops / 1e9:>10.2f}{s.bytes / 1e6:>11.1f}{s.bound_s * 1e3:>10.4f}  "
                     f"{limit}")
    if top and len(summaries) > top:
        rest = summaries[top:]
        lines.append(f"  {'(' + str(len(rest)) + ' more ops)':<34}{sum(s.count for s in rest):>6}"
                     f"{sum(s.flops for s in rest) / 1e9:>10.2f}{sum(s.bytes for s in rest) / 1e6:>11.1f}"
                     f"{sum(s.bound_s for s in rest) * 1e3:>10.4f}")
    lines.append(f"  predicted TTFT >= {prediction.ttft_s * 1e3:.3f} ms ({prediction.flops / 1e9:.2f} GFLOP, "
                 f"{prediction.bytes / 1e6:.1f} MB moved; a roofline bound: peak speed, no overlap, no launch cost)")
    lines.extend(f"  note: {n}" for n in prediction.notes)
    return "\n".join(lines)
