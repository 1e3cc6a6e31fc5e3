"""CPU lowerings of ttftc.norm_linear and ttftc.norm against the op references, with the residual add and norm on
the native row kernel and on ATen."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.codegen.conftest import GEMM_TUNINGS, fp32_gemm_options_or_skip, record_linear_2d, switch_native
from tests.helpers import TOLERANCES
from ttftc.codegen.cpu import norm as cpu_norm
from ttftc.codegen.cpu.norm import native_norm_fits, norm_cpu
from ttftc.codegen.cpu.norm_linear import norm_linear_cpu
from ttftc.codegen.registry import LoweringContext, lowerings_for

norm, norm_linear = torch.ops.ttftc.norm, torch.ops.ttftc.norm_linear

CPU = LoweringContext("cpu", None)


@pytest.fixture(autouse=True, params=["native", "aten"])
def glue(request, monkeypatch):
    """Every test with the norm on the native row kernel (its calls recorded) and on ATen (None)."""
    calls = switch_native(monkeypatch, request.param, [cpu_norm], ("norm",))
    return calls if request.param == "native" else None


def _inputs(dtype, kind, hidden=48, out=40, residual=True, bias=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, hidden, generator=g).to(dtype)
    res = torch.randn(2, 5, hidden, generator=g).to(dtype) if residual else None
    norm_w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    norm_b = torch.randn(hidden, generator=g).to(dtype) if kind == "layer" else None
    w = (torch.randn(out, hidden, generator=g) * 0.2).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    return x, res, norm_w, norm_b, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_linear_cpu_matches_reference(glue, dtype, kind, residual, bias):
    x, res, norm_w, norm_b, w, b = _inputs(dtype, kind, residual=residual, bias=bias)
    expected, expected_res = norm_linear(x, norm_w, norm_b, w, b, res, kind=kind, eps=1e-6)
    actual, actual_res = norm_linear_cpu(x, norm_w, norm_b, w, b, res, kind=kind, eps=1e-6)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    assert actual_res.shape == expected_res.shape
    if residual:
        torch.testing.assert_close(actual_res, expected_res, atol=0, rtol=0)
    assert glue is None or glue == ["norm"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_cpu_matches_reference(dtype, kind):
    x, res, norm_w, norm_b, _, _ = _inputs(dtype, kind)
    expected_y, expected_res = norm(x, norm_w, norm_b, res, kind=kind, eps=1e-5)
    actual_y, actual_res = norm_cpu(x, norm_w, norm_b, res, kind=kind, eps=1e-5)
    # RMSNorm keeps Hugging Face's rounding order, so it agrees to rounding; the native LayerNorm sums the mean and
    # variance in its own lane order (which depends on the ISA), so fp32 differs from ATen's by a few ulps.
    if dtype == torch.float32:
        atol, rtol = (0, 1e-6) if kind == "rms" else (1e-6, 1e-5)
    else:
        atol, rtol = 1e-2, 1e-6
    torch.testing.assert_close(actual_y, expected_y, atol=atol, rtol=rtol)
    torch.testing.assert_close(actual_res, expected_res, atol=0, rtol=0)


def test_bf16_rms_norm_rounds_before_the_weight_like_hugging_face():
    x, _, norm_w, _, _, _ = _inputs(torch.bfloat16, "rms", residual=False)
    y, _ = norm_cpu(x, norm_w, None, None, kind="rms", eps=1e-6)
    xf = x.float()
    hf = norm_w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(y, hf)


def test_capability_reasons():
    (entry,) = [e for e in lowerings_for("norm_linear") if e.provider == "cpu"]
    x, res, norm_w, _, w, _ = _inputs(torch.float32, "rms")
    assert entry.unsupported_reason(CPU, x, norm_w, None, w, None, res, kind="rms", eps=1e-6) is None
    assert "hidden size" in entry.unsupported_reason(CPU, x, norm_w[:-1], None, w, None, res, kind="rms", eps=1e-6)
    assert "float64" in entry.unsupported_reason(CPU, x.double(), norm_w.double(), None, w.double(), kind="rms",
                                                 eps=1e-6)
    assert "npu" in entry.unsupported_reason(LoweringContext("npu", None), x, norm_w, None, w, kind="rms", eps=1e-6)


def test_bf16_rms_norm_with_an_fp32_weight_applies_it_in_fp32_like_hugging_face():
    x, _, norm_w, _, _, _ = _inputs(torch.bfloat16, "rms", residual=False)
    y, _ = norm_cpu(x, norm_w.float(), None, None, kind="rms", eps=1e-6)
    xf = x.float()
    hf = norm_w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert y.dtype == torch.float32 and torch.equal(y, hf)  # the weight promotes the result, as in HF
    assert torch.equal(x, _inputs(torch.bfloat16, "rms", residual=False)[0])  # the input was not written


def test_fp32_rms_norm_uses_the_weight_and_eps():
    x, _, norm_w, _, _, _ = _inputs(torch.float32, "rms", residual=False)
    x = x * 1e-3  # small enough that eps matters
    y, _ = norm_cpu(x, norm_w, None, None, kind="rms", eps=1e-5)
    expected = norm_w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


# eps 1e-2 against rows of variance ~1e-6: the result is far from that of any default eps
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_layer_norm_uses_weight_bias_and_eps(eps):
    x, _, norm_w, norm_b, _, _ = _inputs(torch.float32, "layer", residual=False)
    x = x * 1e-3
    y, res = norm_cpu(x, norm_w, norm_b, None, kind="layer", eps=eps)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(y, (x - mean) / torch.sqrt(var + eps) * norm_w + norm_b, atol=1e-4, rtol=1e-4)
    assert res.numel() == 0


def test_16_bit_rms_norm_uses_the_given_eps_not_a_default():
    x, _, norm_w, _, _, _ = _inputs(torch.float32, "rms", residual=False)
    x = x * 1e-3
    xb = x.bfloat16()
    y, _ = norm_cpu(xb, norm_w.bfloat16(), None, None, kind="rms", eps=1e-2)
    xf = xb.float()
    expected = norm_w.bfloat16() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-2)).bfloat16()
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(y, expected, atol=atol, rtol=rtol)


def test_fp32_rms_norm_with_a_bf16_weight_applies_it_in_fp32_without_a_warning():
    x, _, norm_w, _, _, _ = _inputs(torch.float32, "rms", residual=False)
    with warnings.catch_warnings():
        # torch.rms_norm with a weight of another dtype warns that it cannot use its fused kernel
        warnings.simplefilter("error")
        y, _ = norm_cpu(x, norm_w.bfloat16(), None, None, kind="rms", eps=1e-6)
    expected = norm_w.bfloat16().float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_the_native_layer_norm_takes_only_a_bias_of_the_input_dtype():
    x, _, norm_w, norm_b, _, _ = _inputs(torch.bfloat16, "layer")
    assert native_norm_fits(x, norm_w, norm_b, "layer") == (cpu_norm._native.rows_reason(x) is None)  # per glue
    assert not native_norm_fits(x, norm_w, norm_b.float(), "layer")
    assert not native_norm_fits(x, norm_w, None, "layer")


def test_norm_capability_reasons():
    (entry,) = [e for e in lowerings_for("norm") if e.provider == "cpu"]
    x, res, norm_w, norm_b, _, _ = _inputs(torch.float32, "layer")
    ok = dict(kind="layer", eps=1e-5)
    assert entry.unsupported_reason(CPU, x, norm_w, norm_b, res, **ok) is None
    assert entry.unsupported_reason(CPU, x.half(), norm_w.half(), norm_b.half(), res.half(), **ok) is None
    assert "norm kind 'batch'" in entry.unsupported_reason(CPU, x, norm_w, kind="batch", eps=1e-5)
    assert "tensors on cuda" in entry.unsupported_reason(LoweringContext("cuda", None), x, norm_w, **ok)
    assert "int32 not supported" in entry.unsupported_reason(CPU, x.int(), norm_w, **ok)
    assert entry.unsupported_reason(CPU, x, norm_w[None], **ok) == (
        "norm weight shape (1, 48) does not match hidden size 48")  # x is [2, 5, 48]: the size is the last axis's
    assert "layer norm weight dtype" in entry.unsupported_reason(CPU, x, norm_w.half(), **ok)
    assert entry.unsupported_reason(CPU, x.bfloat16(), norm_w, kind="rms", eps=1e-5) is None  # rms: fp32 weight ok
    assert "residual shape or dtype" in entry.unsupported_reason(CPU, x, norm_w, norm_b, res[:1], **ok)
    assert "residual shape or dtype" in entry.unsupported_reason(CPU, x, norm_w, norm_b, res.half(), **ok)
    assert entry.unsupported_reason(CPU, x, norm_w, norm_b[:7], **ok) == (
        "norm bias shape (7,) does not match hidden size 48")
    assert "norm bias shape" in entry.unsupported_reason(CPU, x, norm_w, norm_b[None], **ok)
    for eps in (None, -1e-5, float("nan"), float("inf"), True, "1e-5"):
        assert "is not a finite non-negative number" in entry.unsupported_reason(CPU, x, norm_w, kind="rms", eps=eps)
    assert entry.unsupported_reason(CPU, x, norm_w, kind="rms", eps=0) is None
    (fused,) = [e for e in lowerings_for("norm_linear") if e.provider == "cpu"]
    _, _, _, _, w, _ = _inputs(torch.bfloat16, "rms")
    assert "GEMM would mix dtypes" in fused.unsupported_reason(CPU, x.bfloat16(), norm_w, None, w, kind="rms",
                                                               eps=1e-6)
    assert "weight dtype" in fused.unsupported_reason(CPU, x, norm_w, None, w, kind="rms", eps=1e-6)
    # the norm's own checks, reached through the fused lowering with every argument in its place
    _, _, _, _, w, _ = _inputs(torch.float32, "layer")
    assert fused.unsupported_reason(CPU, x, norm_w, norm_b, w, None, res, **ok) is None
    assert "residual shape or dtype" in fused.unsupported_reason(CPU, x, norm_w, norm_b, w, None, res[:1], **ok)
    assert "norm bias shape" in fused.unsupported_reason(CPU, x, norm_w, norm_b[:7], w, None, res, **ok)
    assert "not a finite non-negative number" in fused.unsupported_reason(CPU, x, norm_w, norm_b, w, kind="layer",
                                                                          eps=-1.0)


@pytest.mark.parametrize("tuning", GEMM_TUNINGS)
def test_the_norm_linear_gemm_runs_with_the_tuned_options_else_the_dtypes_defaults(monkeypatch, tuning):
    from ttftc.codegen.cpu import norm_linear as cpu_norm_linear
    options = fp32_gemm_options_or_skip(tuning)
    calls = record_linear_2d(monkeypatch, cpu_norm_linear)
    x, norm_w, w = torch.randn(2, 3, 16), torch.randn(16), torch.randn(24, 16)
    out, _ = norm_linear_cpu(x, norm_w, None, w, kind="rms", eps=1e-6, tuning_config=tuning)
    assert calls == [options] and out.shape == (2, 3, 24)
