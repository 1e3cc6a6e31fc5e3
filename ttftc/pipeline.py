"""The graph pipeline both code generators share: passes, then lowering, then the explain report.

The eager code generator runs it on the aten graph ttftc captured itself; the Inductor code generator runs it as
Inductor's post-grad custom pass. Either way the same pass objects see the graph, make the same decisions and
fill the same Report; only the form of a lowered node differs (a Python function, or the lowering's own op).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ttftc.codegen import lowering
from ttftc.codegen.cpu._allocator import keep_freed_pages
from ttftc.codegen.cpu._blas import measured_gemm_backend
from ttftc.codegen.cpu.attention import describe_kernel_choice
from ttftc.codegen.cpu.int8_linear import int8_gemm_choice
from ttftc.config import Config
from ttftc.fx_utils import op_histogram
from ttftc.passes.manager import PassManager
from ttftc.report import Report, graph_flops, make_report


INT8_GEMM_OPS = ("int8_linear", "gated_ffn_int8")
# The CPU lowerings of these run a float GEMM, whose backend is measured per process (codegen/cpu/_blas.py).
FLOAT_GEMM_OPS = ("linear", "norm_linear", "gated_ffn", "linear_act")


def run_pipeline(gm: fx.GraphModule, config: Config, *, autotune_cache=None, as_ops: bool = False,
                 notes: Optional[list[str]] = None) -> Report:
    """Rewrite `gm` in place: every enabled pass in order, then each ttftc op to its chosen lowering."""
    notes = list(notes or [])
    if _has_symbolic_inputs(gm):
        notes.append("compiled with symbolic sizes: a new prompt length reuses this graph")
    ops_before = op_histogram(gm)
    manager = PassManager(config)
    stats = manager.run(gm)
    ops_after = op_histogram(gm)
    flops = graph_flops(gm)
    decisions = lowering.lower_graph(gm, provider=config.provider, autotune=config.autotune,
                                     autotune_cache=autotune_cache, as_ops=as_ops)
    if _runs_on_cpu(gm):
        notes.append(keep_freed_pages())
        if any(d.op in INT8_GEMM_OPS for d in decisions):  # which int8 GEMM runs here, and what it measured
            notes.append(int8_gemm_choice().describe())
        # The defaults measured on this machine, and what they measured, for the ops that use them.
        on_cpu = {d.op for d in decisions if d.provider == "cpu"}
        dtypes = _float_dtypes(gm)
        if on_cpu.intersection(FLOAT_GEMM_OPS):
            notes.extend(measured_gemm_backend(dtype).describe() for dtype in dtypes)
        if "attention" in on_cpu:
            notes.extend(describe_kernel_choice(dtype) for dtype in dtypes)
    return make_report(stats, ops_before, ops_after, decisions, flops, {p.name: p.uuid() for p in manager.passes},
                       notes)


def _float_dtypes(gm: fx.GraphModule) -> list[torch.dtype]:
    """The compute dtypes among fp32 and bf16 that the graph's values carry, in that order."""
    seen = {node.meta["val"].dtype for node in gm.graph.nodes if isinstance(node.meta.get("val"), torch.Tensor)}
    return [dtype for dtype in (torch.float32, torch.bfloat16) if dtype in seen]


def _runs_on_cpu(gm: fx.GraphModule) -> bool:
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device.type == "cpu"
    return False


def _has_symbolic_inputs(gm: fx.GraphModule) -> bool:
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt) or (
                isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape)):
            return True
    return False
