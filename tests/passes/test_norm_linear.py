"""The norm_linear pass: RMSNorm/LayerNorm (+ the residual add before it) fused into the linears they feed."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn

import ttftc
from tests.helpers import assert_logits_match, needs_transformers
from tests.passes.ffn_norm_support import compile_capture, count_gemms, nodes_of, zoo_params
from ttftc import zoo

ALL_FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "phi3", "gemma")
LAYERS = 2  # the tiny zoo models
NORM_LINEAR = torch.ops.ttftc.norm_linear.default
NORM = torch.ops.ttftc.norm.default


@needs_transformers
@pytest.mark.parametrize("family,attn", zoo_params(ALL_FAMILIES))
def test_norm_linear_alone_fuses_every_norm_and_matches_eager(family, attn):
    model = zoo.build(family, attn)
    actual, expected, report, _ = compile_capture(
        model, zoo.example_ids(model, 9), ttftc.Config(passes=("norm_linear",))
    )
    assert_logits_match(actual, expected)
    # Per layer: the attention norm into q|k|v and the MLP norm into gate|up (or c_fc); plus the final norm
    # into the lm_head.
    assert report.pass_counts["norm_linear"] == 2 * LAYERS + 1
    assert report.rejections["norm_linear"] == []
    before, after = report.ops_before, report.ops_after
    assert after["ttftc.norm_linear"] == 2 * LAYERS + 1
    norm_op = "aten.native_layer_norm" if family == "gpt2" else "aten.rsqrt"
    assert before[norm_op] == 2 * LAYERS + 1 and after.get(norm_op, 0) == 0


@needs_transformers
@pytest.mark.parametrize("family,attn", zoo_params(ALL_FAMILIES))
def test_all_passes_match_eager(family, attn):
    model = zoo.build(family, attn)
    actual, expected, report, _ = compile_capture(model, zoo.example_ids(model, 11), ttftc.Config())
    assert_logits_match(actual, expected)
    assert report.pass_counts["ffn"] == LAYERS
    assert report.pass_counts["norm_linear"] == 2 * LAYERS + 1


@needs_transformers
@pytest.mark.parametrize("passes", [("ffn", "norm_linear"), "all"])
def test_llama_layer_has_four_gemms_in_three_ops(passes):
    model = zoo.build("llama", "sdpa")
    actual, expected, report, graphs = compile_capture(model, zoo.example_ids(model, 9), ttftc.Config(passes=passes))
    assert_logits_match(actual, expected)
    assert report.ops_before["aten.mm"] == 7 * LAYERS + 1  # seven linears per layer and the lm_head
    # qkv (one norm_linear), o (mm, or ttftc.linear once the linear pass runs), gate|up + down (one gated_ffn); the
    # lm_head is a norm_linear of its own.
    assert count_gemms(graphs) == 4 * LAYERS + 1
    assert report.ops_after["ttftc.norm_linear"] == LAYERS + 1
    o_proj_op = "ttftc.linear" if passes == "all" else "aten.mm"
    assert report.ops_after[o_proj_op] == LAYERS
    assert report.ops_after.get("aten.mm", 0) == (0 if passes == "all" else LAYERS)
    assert report.ops_after["ttftc.gated_ffn"] == LAYERS
    assert report.ops_after["ttftc.norm"] == LAYERS  # the MLP norm feeds gated_ffn, so it stands alone
    assert report.pass_counts["ffn"] == LAYERS and report.pass_counts["norm_linear"] == 2 * LAYERS + 1
    text = str(report)
    assert any(line.split()[:2] == ["ffn", str(LAYERS)] for line in text.splitlines())
    assert any(line.split()[:2] == ["norm_linear", str(2 * LAYERS + 1)] for line in text.splitlines())


@needs_transformers
def test_qkv_merged_into_one_gemm_split_by_views():
    model = zoo.build("qwen2", "sdpa")  # GQA 4:1 and q/k/v biases
    _, _, _, graphs = compile_capture(model, zoo.example_ids(model, 7), ttftc.Config(passes=("norm_linear",)))
    gm = graphs[0]
    attn = model.model.layers[0].self_attn
    first = nodes_of(graphs, NORM_LINEAR)[0]
    weight, bias = getattr(gm, first.args[3].target), getattr(gm, first.args[4].target)
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    torch.testing.assert_close(weight, torch.cat([p.weight for p in projections]), rtol=0, atol=0)
    torch.testing.assert_close(bias, torch.cat([p.bias for p in projections]), rtol=0, atol=0)
    (out,) = [u for u in first.users if u.args[1] == 0]
    (as_2d,) = out.users
    assert as_2d.target is torch.ops.aten.view.default
    slices = sorted(as_2d.users, key=lambda n: n.args[2])
    assert [n.target for n in slices] == [torch.ops.aten.slice.Tensor] * 3
    assert [(n.args[1], n.args[2], n.args[3]) for n in slices] == [(1, 0, 64), (1, 64, 80), (1, 80, 96)]


@needs_transformers
def test_residual_add_is_fused_and_returned():
    model = zoo.build("llama", "sdpa")
    config = ttftc.Config(passes=("ffn", "norm_linear"))
    _, _, report, graphs = compile_capture(model, zoo.example_ids(model, 7), config)
    with_residual = [n for n in nodes_of(graphs, NORM_LINEAR) if n.args[5] is not None]
    with_residual += [n for n in nodes_of(graphs, NORM) if n.args[3] is not None]
    # Every norm but the first (which reads the embeddings) has a residual add in front of it.
    assert len(with_residual) == 2 * LAYERS
    assert report.ops_after.get("aten.add", 0) <= report.ops_before["aten.add"] - 2 * LAYERS
    # The new residual stream is read from the op (getitem 1) by the next residual add; only the final norm's
    # residual has no reader left.
    readers = [n for n in with_residual if any(u.target is operator.getitem and u.args[1] == 1 for u in n.users)]
    assert len(readers) == 2 * LAYERS - 1


@needs_transformers
def test_gemma_one_plus_w_is_folded_into_the_norm_weight():
    model = zoo.build("gemma", "sdpa")
    _, _, _, graphs = compile_capture(model, zoo.example_ids(model, 5), ttftc.Config(passes=("norm_linear",)))
    first = nodes_of(graphs, NORM_LINEAR)[0]
    norm_w = getattr(graphs[0], first.args[1].target)
    torch.testing.assert_close(norm_w, 1.0 + model.model.layers[0].input_layernorm.weight.float(), rtol=0, atol=0)


@needs_transformers
def test_bf16_llama_matches_and_gemma_style_bf16_norm_is_refused():
    llama = zoo.build("llama", "sdpa", dtype=torch.bfloat16)
    config = ttftc.Config(passes=("norm_linear",))
    actual, expected, report, _ = compile_capture(llama, zoo.example_ids(llama, 7), config)
    assert_logits_match(actual, expected, rel=2e-2)
    assert report.pass_counts["norm_linear"] == 2 * LAYERS + 1
    gemma = zoo.build("gemma", "sdpa", dtype=torch.bfloat16)
    actual, expected, report, _ = compile_capture(gemma, zoo.example_ids(gemma, 7), config)
    assert_logits_match(actual, expected, rel=2e-2)
    assert report.pass_counts["norm_linear"] == 0
    assert all("Gemma style" in r for r in report.rejections["norm_linear"])


@needs_transformers
@pytest.mark.parametrize("dynamic_shapes, graphs", [("auto", 1), ("dynamo", 2)])
def test_symbolic_sequence_length_still_fuses(dynamic_shapes, graphs):
    """"auto" traces the first length symbolic; "dynamo" recompiles with a symbolic length at the second."""
    model = zoo.build("llama", "sdpa")
    backend = ttftc.backend(ttftc.Config(passes=("ffn", "norm_linear"), dynamic_shapes=dynamic_shapes))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for length in (6, 10, 15):
            ids = zoo.example_ids(model, length)
            assert_logits_match(compiled(ids).logits, model(ids).logits)
    report = backend.report()
    assert report.graphs == graphs
    assert report.pass_counts == {"ffn": graphs * LAYERS, "norm_linear": graphs * (2 * LAYERS + 1)}


class _RmsBlock(nn.Module):
    """RMSNorm then two linears, with knobs that break what the guard must prove."""

    def __init__(self, variant: str, hidden: int = 16):
        super().__init__()
        self.variant = variant
        self.weight = nn.Parameter(torch.rand(hidden) + 0.5)
        self.register_buffer("eps", torch.tensor(1e-6))
        self.a, self.b = nn.Linear(hidden, 8, bias=False), nn.Linear(hidden, 24)

    def forward(self, x):
        eps = self.eps if self.variant == "tensor_eps" else 1e-6
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        y = self.weight * (x * rstd)
        out = self.a(y) + self.b(y)[..., :8]
        if self.variant == "leaks_rstd":
            return out, rstd
        if self.variant == "returns_normed":
            return out, y
        return out


@pytest.mark.parametrize(
    "variant,reason",
    [("tensor_eps", "eps is not a constant"), ("leaks_rstd", "read elsewhere")],
)
def test_guard_rejects_unprovable_norms_and_keeps_numerics(variant, reason):
    torch.manual_seed(0)
    block = _RmsBlock(variant).eval()
    x = torch.randn(1, 5, 16)
    backend = ttftc.backend(ttftc.Config(passes=("norm_linear",)))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(block, backend=backend)(x), block(x))
    report = backend.report()
    assert report.pass_counts["norm_linear"] == 0
    assert any(reason in r for r in report.rejections["norm_linear"]), report.rejections


def test_norm_read_by_a_non_linear_becomes_the_standalone_norm_op():
    torch.manual_seed(0)
    block = _RmsBlock("returns_normed").eval()
    x = torch.randn(1, 5, 16)
    backend = ttftc.backend(ttftc.Config(passes=("norm_linear",)))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(block, backend=backend)(x), block(x))
    report = backend.report()
    assert report.pass_counts["norm_linear"] == 1
    assert report.ops_after.get("ttftc.norm") == 1 and "ttftc.norm_linear" not in report.ops_after


def test_two_linears_on_one_norm_share_one_merged_gemm():
    torch.manual_seed(0)
    block = _RmsBlock("plain").eval()
    x = torch.randn(2, 5, 16)
    backend = ttftc.backend(ttftc.Config(passes=("norm_linear",)))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(block, backend=backend)(x), block(x))
    after = backend.report().ops_after
    assert after.get("ttftc.norm_linear") == 1 and "aten.mm" not in after and "aten.addmm" not in after
