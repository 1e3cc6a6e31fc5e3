"""The Triton int8 GEMM and per-token quantisation under the interpreter, against the torch references."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ttftc.ops  # noqa: F401
from tests.helpers import needs_triton
from ttftc.codegen.registry import LoweringContext
from ttftc.ops.int8_linear import int8_linear, quantize_per_token
from ttftc.ops.quant import gated_ffn_int8

pytestmark = [needs_triton, pytest.mark.interpreter]


def _triton():
    from ttftc.codegen.triton import int8_linear as triton_int8

    return triton_int8


@pytest.mark.parametrize("m,k,n", [(5, 32, 16), (37, 80, 48)])  # ragged tiles in every dimension
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm_matches_reference(m, k, n, with_bias):
    torch.manual_seed(0)
    xq, xs = quantize_per_token(torch.randn(m, k))
    w, ws = quantize_per_token(torch.randn(n, k))
    bias = torch.randn(n) if with_bias else None
    actual = _triton().int8_gemm(xq, xs, w, ws, bias, torch.float32)
    expected = int8_linear.reference(xq, xs, w, ws, bias, out_dtype=torch.float32)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-5)


def test_int32_accumulation_does_not_overflow():
    k = 96
    xq = torch.full((3, k), 127, dtype=torch.int8)
    w = torch.full((16, k), -127, dtype=torch.int8)
    out = _triton().int8_gemm(xq, torch.ones(3), w, torch.ones(16), None, torch.float32)
    assert torch.equal(out, torch.full((3, 16), float(-127 * 127 * k)))


def test_bf16_output_is_the_rounded_fp32_result():
    xq, xs = quantize_per_token(torch.randn(9, 32))
    w, ws = quantize_per_token(torch.randn(16, 32))
    out = _triton().int8_gemm(xq, xs, w, ws, None, torch.bfloat16)
    expected = int8_linear.reference(xq, xs, w, ws, out_dtype=torch.float32)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=0, rtol=2 ** -7)


def test_quantize_rows_matches_reference_up_to_ties():
    x = torch.randn(6, 40)
    x[2] = 0
    q, s = _triton().quantize_rows(x)
    q_ref, s_ref = quantize_per_token(x)
    torch.testing.assert_close(s, s_ref)
    assert (q.int() - q_ref.int()).abs().max() <= 1


def test_lowerings_end_to_end_and_capability():
    triton_int8 = _triton()
    forced = LoweringContext(device_type="cpu", forced_provider="triton")
    auto = LoweringContext(device_type="cpu", forced_provider=None)
    x = torch.randn(1, 6, 32)
    w_gu, s_gu = quantize_per_token(torch.randn(64, 32) * 0.1)
    w_d, s_d = quantize_per_token(torch.randn(32, 32) * 0.1)
    args = (x, None, w_gu, s_gu, w_d, s_d)
    assert triton_int8._gated_reason(forced, *args, act="silu", out_dtype=torch.float32) is None
    assert "cuda" in triton_int8._gated_reason(auto, *args, act="silu", out_dtype=torch.float32)
    expected = gated_ffn_int8.reference(*args, act="silu", out_dtype=torch.float32)
    actual = triton_int8.gated_ffn_int8_triton(*args, act="silu", out_dtype=torch.float32)
    torch.testing.assert_close(actual, expected, atol=2e-3 * expected.abs().max().item(), rtol=0)
    lin = triton_int8.int8_linear_triton(x, None, w_d, s_d, out_dtype=torch.float32)
    torch.testing.assert_close(lin, int8_linear.reference(x, None, w_d, s_d, out_dtype=torch.float32),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_int8_model_runs_through_the_triton_kernels():
    import ttftc
    from tests.helpers import compile_and_run
    from ttftc import zoo

    model = zoo.build("llama", "sdpa")
    actual, expected, report = compile_and_run(model, zoo.example_ids(model, 8),
                                               ttftc.Config(precision="int8", provider="triton"))
    assert report.providers["int8_linear"] == {"triton": 4}
    assert report.providers["gated_ffn_int8"] == {"triton": 2}
    cos = torch.nn.functional.cosine_similarity(actual.double().flatten(), expected.double().flatten(), dim=0)
    assert cos >= 0.99
