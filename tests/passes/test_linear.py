"""The linear pass: frozen-weight GEMMs no fusion took become ttftc.linear, with eager's numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ttftc
from tests.helpers import assert_logits_match, needs_transformers
from tests.passes.ffn_norm_support import compile_capture, count_gemms, nodes_of, zoo_params
from ttftc import zoo

LAYERS = 2  # the tiny zoo models
LINEAR = torch.ops.ttftc.linear.default


@needs_transformers
@pytest.mark.parametrize("family,attn", zoo_params(("llama", "qwen2", "mistral", "gpt2")))
def test_linear_alone_takes_every_linear_and_matches_eager(family, attn):
    model = zoo.build(family, attn)
    actual, expected, report, graphs = compile_capture(model, zoo.example_ids(model, 9), ttftc.Config(passes=("linear",)))
    assert_logits_match(actual, expected)
    before, after = report.ops_before, report.ops_after
    linears = before.get("aten.mm", 0) + before.get("aten.addmm", 0)
    assert linears >= 4 * LAYERS + 1
    assert report.pass_counts["linear"] == linears == after["ttftc.linear"]
    assert after.get("aten.mm", 0) == after.get("aten.addmm", 0) == 0
    assert count_gemms(graphs) == linears


@needs_transformers
def test_after_the_fusions_only_o_proj_is_left_for_the_linear_pass():
    model = zoo.build("llama", "sdpa")
    actual, expected, report, graphs = compile_capture(model, zoo.example_ids(model, 9), ttftc.Config())
    assert_logits_match(actual, expected)
    assert report.pass_counts["linear"] == LAYERS
    assert report.providers["linear"] == {"cpu": LAYERS}  # lowered to the CPU GEMM, not left to the reference
    modules = [list(n.meta["nn_module_stack"].values())[-1][0] for n in nodes_of(graphs, LINEAR)]
    assert len(modules) == LAYERS and all(m.endswith("o_proj") for m in modules), modules


@needs_transformers
def test_gpt2_conv1d_weight_reaches_the_op_as_a_transposed_view_not_a_copy():
    model = zoo.build("gpt2", "sdpa")
    actual, expected, report, graphs = compile_capture(model, zoo.example_ids(model, 9), ttftc.Config(passes=("linear",)))
    assert_logits_match(actual, expected)
    conv1d_weights = [n.args[1] for n in nodes_of(graphs, LINEAR) if n.args[1].op == "call_function"]
    assert conv1d_weights and all(w.target is torch.ops.aten.permute.default and list(w.args[1]) == [1, 0]
                                  and w.args[0].op == "get_attr" for w in conv1d_weights)


class _ProductOfActivations(nn.Module):
    """A linear whose output is multiplied by a matrix computed at run time: the second mm has no frozen weight."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, y):
        return torch.mm(self.proj(x), y)


def test_gemm_without_a_frozen_weight_is_rejected_and_left_alone():
    model = _ProductOfActivations().eval()
    x, y = torch.randn(5, 8), torch.randn(8, 3)
    backend = ttftc.backend(ttftc.Config(passes=("linear",)))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x, y), model(x, y))
    report = backend.report()
    assert report.pass_counts["linear"] == 1
    assert any("not a linear with a frozen 2-D weight" in r for r in report.rejections["linear"])
    assert report.ops_after["aten.mm"] == 1 and report.ops_after["ttftc.linear"] == 1


def test_reference_computes_x_times_w_transposed_plus_b():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 6, generator=g), torch.randn(4, 6, generator=g), torch.randn(4, generator=g)
    # Written out in float64 sums, independently of F.linear (the reference's own implementation).
    exact = [[[sum(x[i, t, k].item() * w[n, k].item() for k in range(6)) for n in range(4)] for t in range(3)]
             for i in range(2)]
    exact = torch.tensor(exact, dtype=torch.float64)
    torch.testing.assert_close(torch.ops.ttftc.linear(x, w, b).double(), exact + b.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.ops.ttftc.linear(x, w).double(), exact, atol=1e-5, rtol=1e-5)
