"""Triton gate|up GEMM with the act·mul epilogue (gated_ffn) and GEMM+act (linear_act), under the interpreter
on CPU. Tiny shapes: the interpreter is ~1000x slower than a GPU."""

from __future__ import annotations

import pytest
import torch

import ttftc
from tests.helpers import TOLERANCES, assert_logits_match, needs_transformers, needs_triton
from ttftc import zoo
from ttftc.codegen.registry import LoweringContext, lowerings_for
from ttftc.ops.ffn import ACTIVATIONS

pytestmark = [needs_triton, pytest.mark.interpreter]

gated_ffn, linear_act = torch.ops.ttftc.gated_ffn, torch.ops.ttftc.linear_act
FORCED = LoweringContext("cpu", "triton")


def _inputs(dtype, rows=7, hidden=40, inter=24, bias=False):
    """Odd sizes on purpose: every tile edge is masked."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    w_gate_up = (torch.randn(2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w_down = (torch.randn(hidden, inter, generator=g) * 0.2).to(dtype)
    b_gate_up = torch.randn(2 * inter, generator=g).to(dtype) if bias else None
    b_down = torch.randn(hidden, generator=g).to(dtype) if bias else None
    return x, w_gate_up, w_down, b_gate_up, b_down


def _fp32(*tensors):
    return [t.float() if t is not None else None for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_gated_ffn_kernel_matches_reference(dtype, act):
    from ttftc.codegen.triton.ffn import gated_ffn_triton

    x, w_gu, w_d, b_gu, b_d = _inputs(dtype, bias=act == "silu")
    actual = gated_ffn_triton(x, w_gu, w_d, b_gu, b_d, act=act)
    # The reference in fp32 on the same (rounded) inputs: the kernel accumulates and applies act·mul in fp32.
    expected = gated_ffn(*_fp32(x, w_gu, w_d, b_gu, b_d), act=act)
    assert actual.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=atol * 4, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", ["gelu_tanh", "relu"])
def test_linear_act_kernel_matches_reference(dtype, act):
    from ttftc.codegen.triton.ffn import linear_act_triton

    x, w, _, b, _ = _inputs(dtype, rows=3, bias=True)
    actual = linear_act_triton(x.view(1, 3, -1), w, b, act=act)
    expected = linear_act(*_fp32(x.view(1, 3, -1), w, b), act=act)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=atol * 4, rtol=rtol)


def test_capability_needs_forced_provider_on_cpu():
    (entry,) = [e for e in lowerings_for("gated_ffn") if e.provider == "triton"]
    x, w_gu, w_d, _, _ = _inputs(torch.float32)
    assert entry.unsupported_reason(FORCED, x, w_gu, w_d, act="silu") is None
    assert "cuda" in entry.unsupported_reason(LoweringContext("cpu", None), x, w_gu, w_d, act="silu")
    assert "float64" in entry.unsupported_reason(FORCED, x.double(), w_gu.double(), w_d.double(), act="silu")
    assert "does not fit" in entry.unsupported_reason(FORCED, x, w_gu, w_d[:, :-1], act="silu")


@needs_transformers
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_zoo_model_runs_through_the_triton_kernels(family):
    model = zoo.build(family, "sdpa", num_hidden_layers=1)
    ids = zoo.example_ids(model, 6)
    backend = ttftc.backend(ttftc.Config(provider="triton"))
    with torch.no_grad():
        assert_logits_match(torch.compile(model, backend=backend)(ids).logits, model(ids).logits)
    providers = backend.report().providers
    mlp_op = "linear_act" if family == "gpt2" else "gated_ffn"
    assert providers[mlp_op] == {"triton": 1}
    assert providers["norm_linear"] == {"triton": 2} and providers["norm"] == {"triton": 1}


@needs_transformers
def test_unsupported_dtype_falls_back_to_reference_and_explain_says_so():
    model = zoo.build("llama", "sdpa", num_hidden_layers=1, dtype=torch.float64)
    ids = zoo.example_ids(model, 5)
    report = ttftc.explain(model, ids, config=ttftc.Config(provider="triton"))
    assert report.providers["gated_ffn"] == {"reference": 1}
    assert report.providers["norm_linear"] == {"reference": 2}
    assert any("gated_ffn" in f and "triton" in f and "float64" in f for f in report.fallbacks), report.fallbacks
