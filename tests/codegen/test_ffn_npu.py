"""NPU lowering of ttftc.gated_ffn (npu_swiglu), checked against the recording torch_npu stand-in."""

from __future__ import annotations

import torch

import ttftc
from tests.helpers import assert_logits_match, needs_transformers
from tests.npu_standin import npu_standin  # noqa: F401  (pytest fixture)
from ttftc import zoo
from ttftc.codegen.registry import LoweringContext, lowerings_for

FORCED = LoweringContext("cpu", "npu")


def _inputs(dtype=torch.float32, hidden=32, inter=48):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 5, hidden, generator=g).to(dtype),
            (torch.randn(2 * inter, hidden, generator=g) * 0.2).to(dtype),
            (torch.randn(hidden, inter, generator=g) * 0.2).to(dtype))


def test_gated_ffn_uses_npu_swiglu_on_the_merged_gate_up(npu_standin):
    from ttftc.codegen.npu.ffn import gated_ffn_npu

    x, w_gu, w_d = _inputs()
    out = gated_ffn_npu(x, w_gu, w_d, act="silu")
    torch.testing.assert_close(out, torch.ops.ttftc.gated_ffn(x, w_gu, w_d, act="silu"), atol=1e-5, rtol=1e-5)
    call = npu_standin.last("npu_swiglu")
    assert call.shapes["input"] == (1, 5, 96) and call.kwargs["dim"] == -1


def test_capability_reasons(npu_standin):
    (entry,) = [e for e in lowerings_for("gated_ffn") if e.provider == "npu"]
    x, w_gu, w_d = _inputs()
    assert entry.unsupported_reason(FORCED, x, w_gu, w_d, act="silu") is None
    assert "silu only" in entry.unsupported_reason(FORCED, x, w_gu, w_d, act="gelu_tanh")
    assert "not npu" in entry.unsupported_reason(LoweringContext("cpu", None), x, w_gu, w_d, act="silu")


def test_without_torch_npu_the_lowering_is_not_capable():
    (entry,) = [e for e in lowerings_for("gated_ffn") if e.provider == "npu"]
    x, w_gu, w_d = _inputs()
    assert "torch_npu" in entry.unsupported_reason(LoweringContext("npu", "npu"), x, w_gu, w_d, act="silu")


@needs_transformers
def test_zoo_llama_runs_through_the_npu_lowerings(npu_standin):
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 7)
    backend = ttftc.backend(ttftc.Config(provider="npu"))
    with torch.no_grad():
        assert_logits_match(torch.compile(model, backend=backend)(ids).logits, model(ids).logits)
    report = backend.report()
    assert report.providers["gated_ffn"] == {"npu": 2}
    assert report.providers["norm_linear"] == {"npu": 3} and report.providers["norm"] == {"npu": 2}
    ops = npu_standin.ops()
    assert ops.count("npu_swiglu") == 2
    # Only the first norm reads the embeddings directly; every other one has the residual add fused.
    assert ops.count("npu_rms_norm") == 1 and ops.count("npu_add_rms_norm") == 4


@needs_transformers
def test_gemma_geglu_falls_back_to_the_reference_with_a_reason(npu_standin):
    model = zoo.build("gemma", "sdpa", num_hidden_layers=1)
    report = ttftc.explain(model, zoo.example_ids(model, 5), config=ttftc.Config(provider="npu"))
    assert report.providers["gated_ffn"] == {"reference": 1}
    assert any("npu_swiglu covers silu only" in f for f in report.fallbacks)
    assert "npu_swiglu" not in npu_standin.ops()
