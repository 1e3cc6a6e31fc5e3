"""Test support for the ffn and norm_linear pass tests: compile a model and keep the graphs after the passes."""

from __future__ import annotations

import torch
import torch.fx as fx

import ttftc
from ttftc.dynamo_backend import TtftcBackend

aten = torch.ops.aten

# Linear-layer GEMMs, with how many GEMMs each node runs (gated_ffn: gate|up and down).
GEMM_WEIGHT = {
    aten.mm.default: 1,
    aten.addmm.default: 1,
    torch.ops.ttftc.norm_linear.default: 1,
    torch.ops.ttftc.linear.default: 1,
    torch.ops.ttftc.linear_act.default: 1,
    torch.ops.ttftc.gated_ffn.default: 2,
}


class CapturingBackend(TtftcBackend):
    """A ttftc backend that also keeps each compiled aten graph, copied right after the passes ran."""

    def __init__(self, config):
        super().__init__(config)
        self.graphs: list[fx.GraphModule] = []

    def _compile_real(self, aten_gm, inputs, num_aot_inputs):
        from ttftc.passes.manager import PassManager

        original_run = PassManager.run

        def run_and_copy(manager, gm):
            stats = original_run(manager, gm)
            # GraphModule(root, graph) copies the constants the graph reads; lowering later rewrites `gm`.
            self.graphs.append(fx.GraphModule(gm, _copy_graph(gm.graph)))
            return stats

        PassManager.run = run_and_copy
        try:
            return super()._compile_real(aten_gm, inputs, num_aot_inputs)
        finally:
            PassManager.run = original_run


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    copy = fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


def zoo_params(families):
    """(family, attn) pytest params: sdpa in the quick suite, the "eager" attention variants marked slow."""
    import pytest

    from tests.helpers import zoo_cases

    return [pytest.param(f, a, marks=pytest.mark.slow) if a == "eager" else (f, a) for f, a in zoo_cases(families)]


def compile_capture(model, ids, config: ttftc.Config):
    """(compiled logits, eager logits, report, post-pass graphs)."""
    backend = CapturingBackend(config)
    with torch.no_grad():
        expected = model(ids).logits
        actual = torch.compile(model, backend=backend)(ids).logits
    return actual, expected, backend.report(), backend.graphs


def nodes_of(graphs, target) -> list[fx.Node]:
    return [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def count_gemms(graphs) -> int:
    """GEMMs over linear-layer weights (attention's bmm excluded), counting gated_ffn as two."""
    return sum(GEMM_WEIGHT.get(n.target, 0) for gm in graphs for n in gm.graph.nodes if n.op == "call_function")
