"""The ffn pass: gated MLPs become ttftc.gated_ffn, GPT-2's MLP becomes ttftc.linear_act; numerics stay eager's."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ttftc
from tests.helpers import assert_logits_match, needs_transformers
from tests.passes.ffn_norm_support import compile_capture, nodes_of, zoo_params
from ttftc import zoo

GATED = {"llama": "silu", "qwen2": "silu", "mistral": "silu", "phi3": "silu", "gemma": "gelu_tanh"}
ALL_FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "phi3", "gemma")
LAYERS = 2  # the tiny zoo models


@needs_transformers
@pytest.mark.parametrize("family,attn", zoo_params(ALL_FAMILIES))
def test_ffn_pass_alone_fuses_every_mlp_and_matches_eager(family, attn):
    model = zoo.build(family, attn)
    actual, expected, report, graphs = compile_capture(model, zoo.example_ids(model, 9), ttftc.Config(passes=("ffn",)))
    assert_logits_match(actual, expected)
    assert report.pass_counts["ffn"] == LAYERS
    assert report.rejections["ffn"] == []
    before, after = report.ops_before, report.ops_after
    if family == "gpt2":
        assert after.get("ttftc.linear_act", 0) == LAYERS
        assert before["aten.tanh"] == LAYERS and after.get("aten.tanh", 0) == 0  # gelu_new was decomposed
        # c_fc's addmm is inside linear_act; c_proj's stays.
        assert after["aten.addmm"] == before["aten.addmm"] - LAYERS
        assert all(n.kwargs["act"] == "gelu_tanh" for n in nodes_of(graphs, torch.ops.ttftc.linear_act.default))
        return
    fused = nodes_of(graphs, torch.ops.ttftc.gated_ffn.default)
    assert after["ttftc.gated_ffn"] == LAYERS == len(fused)
    assert {n.kwargs["act"] for n in fused} == {GATED[family]}
    act_op = "aten.silu" if GATED[family] == "silu" else "aten.gelu"
    assert before[act_op] == LAYERS and after.get(act_op, 0) == 0
    linears_per_mlp = 2 if family == "phi3" else 3  # phi3's gate_up_proj is one linear already
    assert after["aten.mm"] == before["aten.mm"] - linears_per_mlp * LAYERS


@needs_transformers
def test_gate_up_weight_is_concatenated_once_gate_first():
    model = zoo.build("llama", "sdpa")
    _, _, _, graphs = compile_capture(model, zoo.example_ids(model, 5), ttftc.Config(passes=("ffn",)))
    gm = graphs[0]
    node = nodes_of(graphs, torch.ops.ttftc.gated_ffn.default)[0]
    w_gate_up = getattr(gm, node.args[1].target)
    mlp = model.model.layers[0].mlp
    torch.testing.assert_close(w_gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), rtol=0, atol=0)
    torch.testing.assert_close(getattr(gm, node.args[2].target), mlp.down_proj.weight, rtol=0, atol=0)


@needs_transformers
def test_phi3_merged_gate_up_is_used_as_is():
    model = zoo.build("phi3", "sdpa")
    _, _, _, graphs = compile_capture(model, zoo.example_ids(model, 5), ttftc.Config(passes=("ffn",)))
    node = nodes_of(graphs, torch.ops.ttftc.gated_ffn.default)[0]
    w_gate_up = getattr(graphs[0], node.args[1].target)
    torch.testing.assert_close(w_gate_up, model.model.layers[0].mlp.gate_up_proj.weight, rtol=0, atol=0)


class _Mlp(nn.Module):
    """A gated MLP whose shape can be bent to test what the guard refuses."""

    def __init__(self, variant: str, hidden: int = 16, inter: int = 32):
        super().__init__()
        self.variant = variant
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, 1 if variant == "broadcast" else inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x, z):
        gate = F.silu(self.gate(x))
        up = self.up(z if self.variant == "two_inputs" else x)
        out = self.down(gate * up)
        return (out, gate) if self.variant == "leaks_gate" else out


@pytest.mark.parametrize(
    "variant,reason",
    [
        ("two_inputs", "gate and up projections read different activations"),
        ("leaks_gate", "is read outside the MLP"),
        ("broadcast", "multiply broadcasts"),
    ],
)
def test_guard_rejects_unprovable_mlps_and_keeps_numerics(variant, reason):
    torch.manual_seed(0)
    mlp = _Mlp(variant).eval()
    x, z = torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    backend = ttftc.backend(ttftc.Config(passes=("ffn",)))
    with torch.no_grad():
        expected = mlp(x, z)
        actual = torch.compile(mlp, backend=backend)(x, z)
    torch.testing.assert_close(actual, expected)
    report = backend.report()
    assert report.pass_counts["ffn"] == 0
    assert any(reason in r for r in report.rejections["ffn"]), report.rejections
    assert "ttftc.gated_ffn" not in report.ops_after


def test_bias_on_gate_and_up_is_concatenated():
    torch.manual_seed(0)

    class BiasedMlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(16, 32), nn.Linear(16, 32, bias=False), nn.Linear(32, 16)

        def forward(self, x):
            return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))

    mlp = BiasedMlp().eval()
    x = torch.randn(2, 3, 16)
    backend = ttftc.backend(ttftc.Config(passes=("ffn",)))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(mlp, backend=backend)(x), mlp(x))
    assert backend.report().ops_after.get("ttftc.gated_ffn") == 1
