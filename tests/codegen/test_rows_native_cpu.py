"""ttftc's native W8A8 row kernels (ttftc/codegen/cpu/csrc/rows_kernel.h) against the ops' references, on every
instruction-set version this CPU can run. The lowerings that call them are tested in test_int8_cpu.py."""

from __future__ import annotations

import pytest
import torch

from ttftc.codegen.cpu import _native
from ttftc.codegen.cpu.ffn import activation_
from ttftc.codegen.cpu.norm import normalize_cpu
from ttftc.ops.int8_linear import quantize_per_token
from ttftc.ops.norm_linear import add_residual, normalize

pytestmark = pytest.mark.skipif(_native.unavailable_reason() is not None, reason=str(_native.unavailable_reason()))

WIDTHS = (7, 64, 203)  # below one vector, whole vectors, a tail


def _dequant_reference(acc, x_scale, w_scale, bias):
    out = torch.mul(acc, w_scale).mul_(x_scale.reshape(-1, 1))
    return out if bias is None else out.add_(bias)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_is_the_reference_bit_for_bit(native_isa, dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(19, width, generator=gen) * torch.logspace(-3, 2, 19)[:, None]).to(dtype)
    x[3] = 0
    q, scale = _native.quantize_rows(x)
    q_ref, scale_ref = quantize_per_token(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_quantize_rows_reads_strided_rows(native_isa):
    x = torch.randn(10, 48)[:, :40]  # row stride 48
    q, scale = _native.quantize_rows(x)
    q_ref, scale_ref = quantize_per_token(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("layer,dtype,weight_dtype", [  # LayerNorm's weight has the input's dtype
    (False, torch.float32, torch.float32), (False, torch.bfloat16, torch.bfloat16), (False, torch.bfloat16, torch.float32),
    (True, torch.float32, torch.float32), (True, torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_quant_matches_the_reference(native_isa, width, layer, dtype, weight_dtype, with_residual):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(13, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(13, width, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(width, generator=gen).to(weight_dtype)
    bias = torch.randn(width, generator=gen).to(weight_dtype) if layer else None
    q, scale, summed = _native.norm_quant(x, weight, bias, residual, layer=layer, eps=1e-5)
    x_in, _ = add_residual(x, residual)
    q_ref, scale_ref = quantize_per_token(normalize(x_in, weight, bias, kind="layer" if layer else "rms", eps=1e-5))
    assert (q.int() - q_ref.int()).abs().max() <= 1  # a tie may move by one step (fp32 summation order)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-5, atol=0)
    if with_residual:
        assert torch.equal(summed, x_in)
    else:
        assert summed is None


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("layer,dtype,weight_dtype", [
    (False, torch.float32, torch.float32), (False, torch.bfloat16, torch.bfloat16), (False, torch.bfloat16, torch.float32),
    (True, torch.float32, torch.float32), (True, torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_matches_the_aten_lowering(native_isa, width, layer, dtype, weight_dtype, with_residual):
    gen = torch.Generator().manual_seed(width + 1)
    x = (torch.randn(13, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(13, width, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(width, generator=gen).to(weight_dtype)
    bias = torch.randn(width, generator=gen).to(weight_dtype) if layer else None
    y, summed = _native.norm(x, weight, bias, residual, layer=layer, eps=1e-5)
    x_in, _ = add_residual(x, residual)
    expected = normalize_cpu(x_in, weight, bias, kind="layer" if layer else "rms", eps=1e-5)
    assert y.dtype == expected.dtype  # the promoted dtype of x and weight
    # fp32: rsqrt against 1/sqrt and the summation order, a few ulps; 16-bit: a rounding step of the dtype at most
    tol = 1e-5 if expected.dtype == torch.float32 and dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.float(), expected.float(), rtol=tol, atol=tol)
    assert (summed is None) == (residual is None) and (summed is None or torch.equal(summed, x_in))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("inter", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_act_matches_the_in_place_aten_path(native_isa, act, inter, dtype):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(9, 2 * inter + 3, generator=gen) * 3).to(dtype)[:, : 2 * inter]  # strided rows
    out = _native.gated_act(gate_up, act)
    expected = activation_(gate_up[:, :inter].clone(), act).mul_(gate_up[:, inter:])
    assert out.is_contiguous() and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dequant_matches_the_reference(native_isa, width, out_dtype, with_bias):
    gen = torch.Generator().manual_seed(width)
    acc = torch.randint(-(1 << 20), 1 << 20, (11, width + 5), generator=gen, dtype=torch.int32)[:, :width]
    x_scale, w_scale = torch.rand(11, generator=gen) * 1e-3, torch.rand(width, generator=gen) * 1e-2
    bias = torch.randn(width, generator=gen) if with_bias else None
    out = _native.dequant(acc, x_scale, w_scale, bias, out_dtype)
    expected = _dequant_reference(acc, x_scale, w_scale, bias).to(out_dtype)
    assert out.dtype == out_dtype and out.shape == (11, width)
    rel = 1e-6 if out_dtype == torch.float32 else 8e-3  # fp32: the bias add may be fused (one rounding less)
    torch.testing.assert_close(out.float(), expected.float(), rtol=rel, atol=rel)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("inter", WIDTHS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_quant_matches_the_reference(native_isa, act, inter, with_bias):
    gen = torch.Generator().manual_seed(inter)
    acc = torch.randint(-4000, 4000, (9, 2 * inter), generator=gen, dtype=torch.int32)
    x_scale, w_scale = torch.rand(9, generator=gen) * 1e-2, torch.rand(2 * inter, generator=gen)
    bias = torch.randn(2 * inter, generator=gen) if with_bias else None
    q, scale = _native.gated_quant(acc, x_scale, w_scale, bias, act)
    gate_up = _dequant_reference(acc, x_scale, w_scale, bias)
    q_ref, scale_ref = quantize_per_token(activation_(gate_up[:, :inter], act).mul_(gate_up[:, inter:]))
    assert (q.int() - q_ref.int()).abs().max() <= 1
    torch.testing.assert_close(scale, scale_ref, rtol=1e-5, atol=0)


def test_huge_activations_saturate_instead_of_overflowing(native_isa):
    """silu/gelu of values far past e^88 must stay finite (the exponential is clamped, not inf/inf)."""
    acc = torch.tensor([[1 << 30, -(1 << 30), 5, -5]], dtype=torch.int32)
    for act in ("silu", "gelu_tanh"):
        q, scale = _native.gated_quant(acc, torch.tensor([1.0]), torch.tensor([1.0, 1.0, 1.0, 1.0]), None, act)
        assert torch.isfinite(scale).all()
        gate_up = _dequant_reference(acc, torch.tensor([1.0]), torch.ones(4), None)
        q_ref, _ = quantize_per_token(activation_(gate_up[:, :2], act).mul_(gate_up[:, 2:]))
        assert (q.int() - q_ref.int()).abs().max() <= 1


def test_row_kernels_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match="fp32 or bf16"):
        _native.quantize_rows(torch.randn(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="activation"):
        _native.gated_quant(torch.zeros(2, 8, dtype=torch.int32), torch.ones(2), torch.ones(8), None, "gelu")
    with pytest.raises(ValueError, match="int32"):
        _native.dequant(torch.zeros(2, 8), torch.ones(2), torch.ones(8), None, torch.float32)
    with pytest.raises(ValueError, match="residual"):
        _native.norm_quant(torch.randn(2, 8), torch.ones(8), None, torch.randn(2, 9), layer=False, eps=1e-5)
