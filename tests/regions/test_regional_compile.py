"""Regional compilation (Config.regions="blocks") on zoo models: each distinct decoder layer is compiled once, the
others reuse its code with their own weights, and the model computes what eager and the whole-graph compile do."""

import pytest
import torch

import ttftc
from tests.helpers import assert_logits_match, needs_transformers
from ttftc import zoo
from ttftc.api import backend_for
from ttftc.passes.linear import LinearPass
from ttftc.regions.backend import RegionalBackend

pytestmark = needs_transformers

LAYERS = 3


def _run(model, ids, config):
    backend = backend_for(config)
    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, backend=backend)(ids).logits
    return logits, backend


def _ttftc_ops(report):
    return {op: n for op, n in report.ops_after.items() if op.startswith("ttftc.")}


# mistral and llama with eager attention: the mask is built before the first layer and read by all of them; the
# attention pass still proves it causal inside a region (regions/extract.py copies its nodes in).
@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("gpt2", "sdpa"), ("gemma", "sdpa"),
                                         ("phi3", "sdpa"), ("mistral", "eager"), ("llama", "eager")])
def test_regional_compile_matches_eager_and_the_whole_graph(family, attn):
    model = zoo.build(family, attn, num_hidden_layers=LAYERS)
    ids = zoo.example_ids(model, 12)
    with torch.no_grad():
        expected = model(ids).logits
    whole, whole_backend = _run(model, ids, ttftc.Config(precision="fp32"))
    regional, backend = _run(model, ids, ttftc.Config(precision="fp32", regions="blocks"))
    assert isinstance(backend, RegionalBackend) and backend.report().pass_counts["attention"] == LAYERS
    [stats] = backend.region_stats
    assert (stats.blocks, stats.regions, stats.full_compiles, stats.reused) == (LAYERS, 1, 1, LAYERS - 1)
    assert_logits_match(regional, expected)
    # The same kernels on the same weights, in the same order: the same numbers as the whole-graph compile.
    assert torch.equal(regional, whole)
    # Every layer's fusions, reused ones included, are in the report (the whole graph's counts).
    assert _ttftc_ops(backend.report()) == _ttftc_ops(whole_backend.report())
    assert _ttftc_ops(backend.report())["ttftc.attention"] == LAYERS


def test_int8_replays_the_quantisation_per_layer():
    model = zoo.build("llama", "sdpa", num_hidden_layers=LAYERS)
    ids = zoo.example_ids(model, 12)
    whole, _ = _run(model, ids, ttftc.Config(precision="int8"))
    regional, backend = _run(model, ids, ttftc.Config(precision="int8", regions="blocks"))
    [stats] = backend.region_stats
    assert (stats.full_compiles, stats.reused) == (1, LAYERS - 1)
    assert torch.equal(regional, whole)


def test_each_layer_computes_with_its_own_weights():
    base = zoo.build("llama", "sdpa", num_hidden_layers=LAYERS)
    changed = zoo.build("llama", "sdpa", num_hidden_layers=LAYERS)
    with torch.no_grad():  # only the last layer, whose code is reused from the first, differs
        changed.model.layers[LAYERS - 1].mlp.down_proj.weight.mul_(3.0)
    ids = zoo.example_ids(base, 12)
    outputs = {}
    for name, model in (("base", base), ("changed", changed)):
        with torch.no_grad():
            expected = model(ids).logits
        outputs[name], backend = _run(model, ids, ttftc.Config(precision="fp32", regions="blocks"))
        assert backend.region_stats[0].reused == LAYERS - 1
        assert_logits_match(outputs[name], expected)
    assert not torch.allclose(outputs["base"], outputs["changed"], atol=1e-3)


def test_a_layer_of_another_shape_is_a_region_of_its_own():
    from transformers.models.llama.modeling_llama import LlamaMLP

    model = zoo.build("llama", "sdpa", num_hidden_layers=4)
    narrow = model.config.__class__(**{**model.config.to_dict(), "intermediate_size": 96})
    torch.manual_seed(3)
    model.model.layers[1].mlp = LlamaMLP(narrow).eval()
    ids = zoo.example_ids(model, 12)
    with torch.no_grad():
        expected = model(ids).logits
    regional, backend = _run(model, ids, ttftc.Config(precision="fp32", regions="blocks"))
    [stats] = backend.region_stats
    # layers 0, 2, 3 share one region (one compile, two reuses); layer 1 is a region of its own (one compile).
    assert (stats.blocks, stats.regions, stats.full_compiles, stats.reused) == (4, 2, 2, 2)
    assert_logits_match(regional, expected)
    notes = "\n".join(backend.report().notes)
    assert "4 repeated blocks in 2 distinct region(s)" in notes
    assert "model.layers.1: compiled on its own (no other block has its structure)" in notes


def test_a_pass_decision_on_weight_values_falls_back_to_a_compile_per_layer(monkeypatch):
    guard = LinearPass.guard

    def reads_values(self, gm, node):  # a guard that decides on a weight's values, not its shape
        reason = guard(self, gm, node)
        weight = gm.get_buffer(node.args[1].target) if node.args[1].op == "get_attr" else None
        if weight is None and node.args[1].args and node.args[1].args[0].op == "get_attr":
            weight = gm.get_buffer(node.args[1].args[0].target)
        if weight is not None and float(weight.abs().sum()) < 0:
            return "never: but the decision read the weight's values"
        return reason

    monkeypatch.setattr(LinearPass, "guard", reads_values)
    model = zoo.build("llama", "sdpa", num_hidden_layers=LAYERS)
    ids = zoo.example_ids(model, 12)
    with torch.no_grad():
        expected = model(ids).logits
    regional, backend = _run(model, ids, ttftc.Config(precision="fp32", regions="blocks"))
    [stats] = backend.region_stats
    # Each layer's weights read another value, so no layer may reuse the first one's decisions.
    assert (stats.full_compiles, stats.reused) == (LAYERS, 0)
    assert_logits_match(regional, expected)
    assert "read" in "\n".join(backend.report().notes)


def test_explain_says_how_many_regions_and_why():
    model = zoo.build("llama", "sdpa", num_hidden_layers=LAYERS)
    ids = zoo.example_ids(model, 12)
    text = str(ttftc.explain(model, ids, config=ttftc.Config(precision="fp32", regions="blocks")))
    assert f"regions: {LAYERS} repeated blocks in 1 distinct region(s); 1 compiled, {LAYERS - 1} reused" in text
    assert f"region model.layers.0 .. model.layers.{LAYERS - 1} ({LAYERS} blocks): compiled once" in text


def test_regions_need_the_eager_code_generator():
    with pytest.raises(ValueError, match="regions='off'"):
        ttftc.Config(regions="blocks", codegen="inductor")
    with pytest.raises(ValueError, match="Unknown regions"):
        ttftc.Config(regions="layers")


def test_a_graph_regions_cannot_split_compiles_whole(monkeypatch):
    import ttftc.regions.compile as regional

    def broken(*args, **kwargs):
        raise RuntimeError("no split for this graph")

    monkeypatch.setattr(regional, "_stitch", broken)  # fails halfway, after the first region compiled
    model = zoo.build("llama", "sdpa", num_hidden_layers=LAYERS)
    ids = zoo.example_ids(model, 12)
    with torch.no_grad():
        expected = model(ids).logits
    with pytest.warns(UserWarning, match="no split for this graph"):
        regional_logits, backend = _run(model, ids, ttftc.Config(precision="fp32", regions="blocks"))
    assert_logits_match(regional_logits, expected)
    assert backend.report().pass_counts["attention"] == LAYERS  # the whole graph's passes ran
    assert any("compiled whole" in note for note in backend.report().notes)


def test_greedy_tokens_equal_eager():
    model = zoo.build("qwen2", "sdpa", num_hidden_layers=LAYERS)
    ids = zoo.example_ids(model, 10)
    backend = backend_for(ttftc.Config(precision="fp32", regions="blocks"))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    eager_ids, compiled_ids = ids, ids
    with torch.no_grad():
        for _ in range(5):  # a full prefill per step: every step a new prompt length, one symbolic-length graph
            eager_ids = torch.cat([eager_ids, model(eager_ids).logits[:, -1:].argmax(-1)], dim=1)
            compiled_ids = torch.cat([compiled_ids, compiled(compiled_ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(compiled_ids, eager_ids)
    assert backend.region_stats[0].reused == LAYERS - 1
