"""CPU lowerings of the W8A8 ops against their torch references (tiny shapes)."""

from __future__ import annotations

import pytest
import torch

import ttftc.ops  # noqa: F401
from ttftc.codegen.cpu import int8_linear as cpu
from ttftc.codegen.lowering import LoweringContext
from ttftc.ops.int8_linear import int8_linear, quantize_per_token
from ttftc.ops.quant import gated_ffn_int8, norm_quant

CPU = LoweringContext(device_type="cpu", forced_provider=None)


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_per_token(torch.randn(n, k, generator=g) * 0.1)


@pytest.mark.parametrize("tokens", [5, 40, cpu.ROW_BLOCK + 37])  # below and across the row blocking
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_reference(tokens, out_dtype):
    torch.manual_seed(0)
    x = torch.randn(1, tokens, 64)
    w, s = _weights(48, 64)
    bias = torch.randn(48)
    expected = int8_linear.reference(x, None, w, s, bias, out_dtype=out_dtype)
    actual = cpu.int8_linear_cpu(x, None, w, s, bias, out_dtype=out_dtype)
    assert actual.shape == expected.shape and actual.dtype == out_dtype
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def test_int8_linear_with_prequantised_input():
    x = torch.randn(30, 64)
    q, scale = quantize_per_token(x)
    w, s = _weights(16, 64)
    expected = int8_linear.reference(q, scale, w, s, out_dtype=torch.float32)
    torch.testing.assert_close(cpu.int8_linear_cpu(q, scale, w, s, out_dtype=torch.float32), expected)


def test_quantize_rows_is_bit_exact_with_the_reference():
    x = torch.randn(33, 100) * torch.linspace(0.01, 10, 33)[:, None]
    x[4] = 0  # an all-zero row must not divide by zero
    q, scale = cpu.quantize_rows(x)
    q_ref, scale_ref = quantize_per_token(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_quant_matches_reference(kind, with_residual):
    torch.manual_seed(1)
    x, residual = torch.randn(2, 9, 64), torch.randn(2, 9, 64)
    norm_w, norm_b = torch.randn(64), (torch.randn(64) if kind == "layer" else None)
    res = residual if with_residual else None
    q, s, r = cpu.norm_quant_cpu(x, norm_w, norm_b, res, kind=kind, eps=1e-5)
    q_ref, s_ref, r_ref = norm_quant.reference(x, norm_w, norm_b, res, kind=kind, eps=1e-5)
    assert q.shape == q_ref.shape and s.shape == s_ref.shape == (2, 9)
    assert (q.int() - q_ref.int()).abs().max() <= 1  # fused-kernel rounding may move a tie by one step
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(r, r_ref)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens", [7, cpu.ROW_BLOCK + 3])
def test_gated_ffn_int8_matches_reference(act, tokens):
    torch.manual_seed(2)
    x = torch.randn(tokens, 64)
    w_gu, s_gu = _weights(2 * 96, 64, seed=3)
    w_d, s_d = _weights(64, 96, seed=4)
    expected = gated_ffn_int8.reference(x, None, w_gu, s_gu, w_d, s_d, act=act, out_dtype=torch.float32)
    actual = cpu.gated_ffn_int8_cpu(x, None, w_gu, s_gu, w_d, s_d, act=act,
                                    out_dtype=torch.float32)
    # The activation between the GEMMs is requantised; fp32 summation order can move a tie by one step there.
    torch.testing.assert_close(actual, expected, atol=2e-3 * expected.abs().max().item(), rtol=0)


def test_capability_checks_explain_refusals():
    x = torch.randn(4, 64)
    w, s = _weights(8, 64)
    assert cpu._int8_linear_reason(CPU, x, None, w, s, None, out_dtype=torch.float32) is None
    cuda = LoweringContext(device_type="cuda", forced_provider=None)
    assert "cuda" in cpu._int8_linear_reason(cuda, x, None, w, s, None, out_dtype=torch.float32)
    assert "int8" in cpu._int8_linear_reason(CPU, x, s[:4], w, s, None, out_dtype=torch.float32)
    assert "fit" in cpu._int8_linear_reason(CPU, torch.randn(4, 32), None, w, s, None, out_dtype=torch.float32)
