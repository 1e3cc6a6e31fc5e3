"""The Inductor code generator: the same passes as Inductor's post-grad pass, lowered ops as extern kernels.

Each case compiles a tiny zoo model with both code generators and checks that Inductor's graph got the same
fusions (pass counts and ttftc op histogram) and eager's logits.
"""

import importlib

import pytest
import torch

import ttftc
from tests.helpers import assert_logits_match, compile_and_run, needs_transformers
from ttftc import zoo
from ttftc.inductor_pass import TtftcPostGradPass, decompose_for_inductor, post_grad_pass
from ttftc.codegen.lowered_ops import NAMESPACE, lowered_op
from ttftc.codegen import lowering, registry
from ttftc.codegen.registry import lowerings_for

pytestmark = needs_transformers


@pytest.fixture(autouse=True)
def _passes_run_in_this_process():
    # A graph served from Inductor's FX graph cache (a test run before this one) skips the pass that reports.
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield


def _ttftc_ops(report) -> dict:
    return {op: n for op, n in report.ops_after.items() if op.startswith("ttftc.")}


def _inductor_ran(report) -> bool:
    """Attention and the GEMMs went to their CPU kernels; the glue-heavy ops were inlined for Inductor."""
    providers = report.providers
    return (report.graphs >= 1 and set(providers["attention"]) == {"cpu"} and set(providers["linear"]) == {"cpu"}
            and set(providers["norm_linear"]) == {"inductor"})


@pytest.mark.parametrize("family", tuple(zoo.FAMILIES))
def test_inductor_codegen_fuses_what_eager_codegen_fuses_and_matches_eager(family):
    model = zoo.build(family, "sdpa")
    ids = zoo.example_ids(model, 13)
    _, _, eager_report = compile_and_run(model, ids, ttftc.Config(codegen="eager"))
    torch._dynamo.reset()
    actual, expected, report = compile_and_run(model, ids, ttftc.Config(codegen="inductor"))
    assert_logits_match(actual, expected)
    assert report.pass_counts == eager_report.pass_counts
    assert _ttftc_ops(report) == _ttftc_ops(eager_report)
    assert report.pass_counts["attention"] == 2 and report.pass_counts["norm_linear"] >= 3
    assert _inductor_ran(report)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_inductor_codegen_runs_the_precision_policy(precision):
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 16)
    eager_logits, _, eager_report = compile_and_run(model, ids, ttftc.Config(codegen="eager", precision=precision))
    torch._dynamo.reset()
    actual, expected, report = compile_and_run(model, ids, ttftc.Config(codegen="inductor", precision=precision))
    assert _ttftc_ops(report) == _ttftc_ops(eager_report)
    assert report.pass_counts["precision"] == eager_report.pass_counts["precision"] > 0
    # Same decisions, same numerics contract: the two generators differ in how the glue runs, and a fused
    # quantiser may round a tie the other way (one int8 step on one element).
    assert_logits_match(actual, eager_logits, rel=1e-2)
    cosine = torch.nn.functional.cosine_similarity(actual.flatten(), expected.flatten(), dim=0)
    assert cosine > 0.999


def test_inductor_codegen_on_the_eager_attention_model():
    model = zoo.build("llama", "eager")
    ids = zoo.example_ids(model, 11)
    actual, expected, report = compile_and_run(model, ids, ttftc.Config(codegen="inductor"))
    assert_logits_match(actual, expected)
    assert report.pass_counts["attention"] == 2


def test_lowered_op_has_the_semantic_schema_plus_tuning():
    (cpu,) = [entry for entry in lowerings_for("gated_ffn") if entry.provider == "cpu"]
    op = lowered_op(cpu)
    assert op.namespace == NAMESPACE
    schema = op._schema
    names = [a.name for a in schema.arguments]
    assert names == ["x", "w_gate_up", "w_down", "b_gate_up", "b_down", "act", "tuning"]
    assert schema.arguments[-1].kwarg_only and schema.arguments[-1].default_value == ""
    x, w_gu, w_down = torch.randn(5, 8), torch.randn(12, 8), torch.randn(8, 6)
    expected = torch.ops.ttftc.gated_ffn(x, w_gu, w_down, act="silu")
    torch.testing.assert_close(op(x, w_gu, w_down, act="silu"), expected)
    tuned = op(x, w_gu, w_down, act="silu", tuning='{"gemm": "blas", "n_block": 4}')
    torch.testing.assert_close(tuned, expected)


def test_lowered_attention_returns_the_layout_its_fake_declares():
    (cpu,) = [entry for entry in lowerings_for("attention") if entry.provider == "cpu"]
    op = lowered_op(cpu)
    q, k, v = (torch.randn(1, 4, 9, 16) for _ in range(3))
    for q_offset in (0, 3):
        kv = (torch.randn(1, 4, 9 + q_offset, 16), torch.randn(1, 4, 9 + q_offset, 16))
        out = op(q, *kv, causal=True, scale=0.3, q_offset=q_offset)
        with torch._subclasses.FakeTensorMode() as mode:
            fake = op(mode.from_tensor(q), *(mode.from_tensor(t) for t in kv), causal=True, scale=0.3,
                      q_offset=q_offset)
        assert out.shape == fake.shape and out.stride() == fake.stride()
        torch.testing.assert_close(out, torch.ops.ttftc.attention(q, *kv, causal=True, scale=0.3, q_offset=q_offset))


def test_decompose_for_inductor_inlines_a_cast():
    def f(x):
        return torch.ops.aten._to_copy.default(x * 2, dtype=torch.bfloat16) + 1

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.randn(4))
    decompose_for_inductor(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten._to_copy.default not in targets
    assert torch.ops.prims.convert_element_type.default in targets
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), f(x))


def test_the_pass_vllm_loads_by_name_runs_under_plain_inductor():
    """vLLM's `compilation_config.inductor_passes` hook is Inductor's `post_grad_custom_post_pass` option."""
    module_name, _, attr = "ttftc.inductor_pass.post_grad_pass".rpartition(".")
    resolved = getattr(importlib.import_module(module_name), attr)
    assert resolved is post_grad_pass and isinstance(resolved, TtftcPostGradPass)
    assert len(resolved.uuid()) == 64 and resolved.uuid() == TtftcPostGradPass().uuid()

    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 10)
    reports: list = []
    counting = TtftcPostGradPass(reports=reports)
    options = {"post_grad_custom_post_pass": counting, "cpp.weight_prepack": False, "fx_graph_cache": False}
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        expected = model(ids).logits
        actual = torch.compile(model, backend="inductor", options=options)(ids).logits
    assert_logits_match(actual, expected)
    (report,) = reports
    assert report.pass_counts["attention"] == 2 and report.pass_counts["ffn"] == 2


def test_without_freezing_only_weight_free_fusions_apply_and_the_report_says_why():
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 10)
    reports: list = []
    options = {"post_grad_custom_post_pass": TtftcPostGradPass(reports=reports), "fx_graph_cache": False}
    with torch.no_grad():
        expected = model(ids).logits
        actual = torch.compile(model, backend="inductor", options=options)(ids).logits
    assert_logits_match(actual, expected)
    (report,) = reports
    assert report.pass_counts["attention"] == 2
    assert report.pass_counts["ffn"] == 0
    assert any("no frozen weights" in note for note in report.notes)


def test_uuid_follows_the_config():
    assert TtftcPostGradPass(ttftc.Config(precision="bf16")).uuid() != TtftcPostGradPass().uuid()


def test_a_decomposition_that_fails_to_inline_falls_back_to_the_kernel(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("cannot trace this")

    entries = [e for e in registry.lowerings_for("gated_ffn") if e.provider != registry.INLINE]
    inline = registry.Lowering("gated_ffn", registry.INLINE, broken, lambda ctx, *a, **k: None, priority=100)
    monkeypatch.setitem(registry._LOWERINGS, "gated_ffn", [inline] + entries)

    def fn(x, w_gate_up, w_down):
        return torch.ops.ttftc.gated_ffn(x, w_gate_up, w_down, act="silu")

    x, w_gate_up, w_down = torch.randn(5, 8), torch.randn(12, 8), torch.randn(8, 6)
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake")(x, w_gate_up, w_down)
    (decision,) = lowering.lower_graph(gm, provider="auto", autotune=False, as_ops=True)
    assert decision.provider == "cpu"
    assert any("inlining raised RuntimeError" in s for s in decision.skipped)
    torch.testing.assert_close(gm(x, w_gate_up, w_down), fn(x, w_gate_up, w_down))
