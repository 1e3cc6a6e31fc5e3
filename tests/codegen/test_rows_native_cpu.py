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


def test_without_the_extension_the_row_kernels_say_why(monkeypatch):
    monkeypatch.setattr(_native, "unavailable_reason", lambda: "the native kernels are not built")
    assert _native.rows_reason(torch.zeros(2, 4)) == "the native kernels are not built"


def test_the_row_kernels_read_cpu_tensors_only():
    assert _native.rows_reason(torch.zeros(2, 4, device="meta")) == "tensors are not on the CPU"


def test_the_kernels_run_on_torchs_thread_count(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert _native._threads() == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 0)  # never fewer than one
    assert _native._threads() == 1


def test_rows_are_ready_when_unit_stride_or_empty():
    assert _native._rows_ready(torch.zeros(2, 4), torch.zeros(3, 8)[:, :4])
    assert _native._rows_ready(torch.empty(0, 4).t())  # no element to read, whatever the strides
    assert not _native._rows_ready(torch.zeros(2, 2)[:1, ::2])  # one element, but a row stride of 2
    assert not _native._rows_ready(torch.zeros(2, 4), torch.zeros(4, 2).t())


@pytest.mark.parametrize("layer", [False, True])
def test_norm_quant_of_zero_width_rows_scales_them_as_quantize_rows_does(native_isa, layer):
    x, weight = torch.zeros(3, 0), torch.zeros(0)
    q, scale, summed = _native.norm_quant(x, weight, torch.zeros(0) if layer else None, x, layer=layer, eps=1e-5)
    assert q.shape == (3, 0) and summed.shape == (3, 0)
    assert torch.equal(scale, _native.quantize_rows(x)[1]) and torch.equal(scale, torch.full((3,), 1e-8 / 127))
    assert _native.norm_quant(torch.zeros(0, 8), torch.ones(8), None, None, layer=False, eps=1e-5)[1].shape == (0,)


def test_gated_act_refuses_an_odd_width_and_of_no_rows_or_columns_is_empty(native_isa):
    with pytest.raises(ValueError) as refused:
        _native.gated_act(torch.zeros(2, 5), "silu")
    assert str(refused.value) == "gated_act: an odd gate|up width"
    assert _native.gated_act(torch.zeros(0, 8), "silu").shape == (0, 4)
    assert _native.gated_act(torch.zeros(3, 0), "silu").shape == (3, 0)


def _gated_quant_refusal(acc, x_scale, w_scale, bias=None, act="silu") -> str:
    with pytest.raises(ValueError) as refused:
        _native.gated_quant(acc, x_scale, w_scale, bias, act)
    return str(refused.value)


def test_gated_quant_refuses_each_malformed_operand_by_name(monkeypatch):
    acc, x_scale, w_scale = torch.zeros(2, 8, dtype=torch.int32), torch.ones(2), torch.ones(8)
    bad_acc = "gated_quant: acc must be int32 [M, 2I]"
    assert _gated_quant_refusal(acc.float(), x_scale, w_scale) == bad_acc
    assert _gated_quant_refusal(torch.zeros(8, 2, dtype=torch.int32).t(), x_scale, w_scale) == bad_acc  # strided
    assert _gated_quant_refusal(torch.zeros(2, 7, dtype=torch.int32), x_scale, torch.ones(7)) == bad_acc  # odd 2I
    assert _gated_quant_refusal(acc, torch.ones(3), w_scale) == "gated_quant: scales"
    assert _gated_quant_refusal(acc, x_scale, torch.ones(6)) == "gated_quant: scales"
    assert _gated_quant_refusal(acc, x_scale, w_scale, torch.ones(6)) == "gated_quant: scales"
    assert _gated_quant_refusal(acc, x_scale, w_scale, act="gelu") == "gated_quant: activation 'gelu'"
    monkeypatch.setattr(_native, "unavailable_reason", lambda: "no native build here")
    assert _gated_quant_refusal(acc, x_scale, w_scale) == "gated_quant: no native build here"


_ROWS = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))

# Each quantiser, its inputs built inside the call (so under the default dtype of the moment, as a caller's would be).
_QUANTISERS = {
    "gated_quant": lambda: _native.gated_quant(torch.tensor([[100, -50, 3, 4]], dtype=torch.int32),
                                               torch.tensor([0.01]), torch.ones(4), None, "relu"),
    "quantize_rows": lambda: _native.quantize_rows(_ROWS),
    "norm_quant": lambda: _native.norm_quant(_ROWS, torch.ones(16, dtype=torch.float32), None, None, layer=False,
                                             eps=1e-5)[:2],
}


@pytest.mark.parametrize("quantiser", sorted(_QUANTISERS))
def test_scales_are_fp32_whatever_the_default_dtype(quantiser):
    expected_q, expected_scale = _QUANTISERS[quantiser]()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        q, scale = _QUANTISERS[quantiser]()
    finally:
        torch.set_default_dtype(previous)
    assert scale.dtype == torch.float32 and torch.equal(scale, expected_scale) and torch.equal(q, expected_q)


def test_quantize_rows_refuses_other_dtypes_and_non_unit_stride_rows_by_name(monkeypatch):
    with pytest.raises(ValueError) as refused:
        _native.quantize_rows(torch.randn(4, 8, dtype=torch.float16))
    assert str(refused.value) == "quantize_rows: the native row kernels read fp32 or bf16, not torch.float16"
    with pytest.raises(ValueError) as refused:
        _native.quantize_rows(torch.randn(8, 4).t())  # columns one row apart: the kernel reads rows
    assert str(refused.value) == ("quantize_rows: expects a [M, K] matrix with unit-stride rows, got shape (4, 8) "
                                  "strides (1, 4)")
    with pytest.raises(ValueError, match=r"^quantize_rows: expects a \[M, K\] matrix .* shape \(2, 4, 8\)"):
        _native.quantize_rows(torch.randn(2, 4, 8))
    monkeypatch.setattr(_native, "unavailable_reason", lambda: "no native build here")
    with pytest.raises(ValueError) as refused:
        _native.dequant(torch.zeros(2, 8, dtype=torch.int32), torch.ones(2), torch.ones(8), None, torch.float32)
    assert str(refused.value) == "dequant: no native build here"


def test_quantize_rows_of_zero_width_get_the_floor_scale():
    # the scale of an all-zero row: amax clamped to 1e-8, over 127
    q, scale = _native.quantize_rows(torch.empty(3, 0))
    assert q.shape == (3, 0) and torch.equal(scale, torch.full((3,), 1e-8 / 127.0))


def _dequant_refusal(acc, x_scale, w_scale, bias=None, out_dtype=torch.float32) -> str:
    with pytest.raises(ValueError) as refused:
        _native.dequant(acc, x_scale, w_scale, bias, out_dtype)
    return str(refused.value)


def test_dequant_refuses_each_malformed_operand_by_name():
    acc, x_scale, w_scale = torch.zeros(2, 8, dtype=torch.int32), torch.ones(2), torch.ones(8)
    assert _dequant_refusal(acc.float(), x_scale, w_scale) == "dequant: acc must be int32 rows"
    assert _dequant_refusal(torch.zeros(8, 2, dtype=torch.int32).t(), x_scale, w_scale) == (
        "dequant: acc must be int32 rows")
    assert _dequant_refusal(acc, x_scale, w_scale, out_dtype=torch.float16) == "dequant: out dtype torch.float16"
    assert _dequant_refusal(acc, torch.ones(3), w_scale) == "dequant: scales"
    assert _dequant_refusal(acc, x_scale, torch.ones(6)) == "dequant: scales"
    assert _dequant_refusal(acc, x_scale, w_scale, torch.ones(6)) == "dequant: scales"


def test_dequant_of_no_columns_or_no_rows_is_empty():
    assert _native.dequant(torch.zeros(3, 0, dtype=torch.int32), torch.ones(3), torch.ones(0), None,
                           torch.float32).shape == (3, 0)
    assert _native.dequant(torch.zeros(0, 4, dtype=torch.int32), torch.ones(0), torch.ones(4), None,
                           torch.bfloat16).shape == (0, 4)


def test_gated_quant_of_zero_width_gives_the_floor_scale():
    q, scale = _native.gated_quant(torch.zeros(3, 0, dtype=torch.int32), torch.ones(3), torch.ones(0), None, "silu")
    assert q.shape == (3, 0) and torch.equal(scale, torch.full((3,), 1e-8 / 127.0))


def _refusal(call) -> str:
    if _native.unavailable_reason() is not None:
        pytest.skip(_native.unavailable_reason())
    with pytest.raises(ValueError) as refused:
        call()
    return str(refused.value)


_K = 8
_X, _W, _B = torch.zeros(2, _K), torch.ones(_K), torch.zeros(_K)
_STRIDED = torch.zeros(_K, 2)[:, 0]  # [K] with a stride of 2
_LAYER_NEEDS = "norm: LayerNorm needs weight and bias of x's dtype"


# each case breaks one condition of one check, so a check whose and/or is flipped lets it through
@pytest.mark.parametrize("args, layer, message", [
    ((_X.half(), _W.half(), None, None), False, "norm: the native row kernels read fp32 or bf16, not torch.float16"),
    ((torch.zeros(_K, 2).t(), _W, None, None), False, "norm: shapes"),  # x not contiguous
    ((_X, _STRIDED, None, None), False, "norm: shapes"),  # weight not contiguous
    ((_X, torch.ones(_K // 2), None, None), False, "norm: shapes"),
    ((_X, _W.half(), None, None), False, "norm: weight dtype torch.float16"),
    ((_X, _W, None, None), True, _LAYER_NEEDS),
    ((_X, _W, _STRIDED, None), True, _LAYER_NEEDS),
    ((_X, _W, torch.zeros(_K // 2), None), True, _LAYER_NEEDS),
    ((_X, _W, _B.bfloat16(), None), True, _LAYER_NEEDS),
    ((_X.bfloat16(), _W, _B, None), True, _LAYER_NEEDS),  # fp32 weight and bias for bf16 x: RMSNorm only
    ((_X, _W, None, torch.zeros(2, _K + 1)), False, "norm: the residual must match x"),
    ((_X, _W, None, torch.zeros(2, _K).bfloat16()), False, "norm: the residual must match x"),
    ((_X, _W, None, torch.zeros(_K, 2).t()), False, "norm: the residual must match x"),
], ids=["x-dtype", "x-strided", "weight-strided", "weight-shape", "weight-dtype", "layer-no-bias", "layer-bias-strided",
        "layer-bias-shape", "layer-bias-dtype", "layer-weight-not-x-dtype", "residual-shape", "residual-dtype",
        "residual-strided"])
def test_the_native_norm_refuses_each_malformed_operand_by_name(args, layer, message):
    assert _refusal(lambda: _native.norm(*args, layer=layer, eps=1e-5)) == message
    assert _refusal(lambda: _native.norm_quant(*args, layer=layer, eps=1e-5)) == message


_XR = torch.zeros(1, 2, 3, 4)
_TABLE = torch.zeros(1, 1, 3, 4)
_ROPE_STRIDE = "rope: x, cos, sin and out need a unit stride along the head dimension"


_NOT_A_MATRIX = "gated_act: expects a [M, K] matrix with unit-stride rows, got shape {} strides {}"


@pytest.mark.parametrize("gate_up, act, message", [
    (torch.zeros(2, 8, dtype=torch.float16), "silu", "gated_act: the native row kernels read fp32 or bf16, not "
                                                     "torch.float16"),
    (torch.zeros(2, 2, 8), "silu", _NOT_A_MATRIX.format((2, 2, 8), (16, 8, 1))),
    (torch.zeros(8, 2).t(), "silu", _NOT_A_MATRIX.format((2, 8), (1, 2))),
    (torch.zeros(2, 8), "gelu", "gated_act: activation 'gelu'"),  # the erf form: not a native one
], ids=["float16", "three-dimensional", "column-major", "activation"])
def test_gated_act_refuses_each_malformed_operand_by_name(gate_up, act, message):
    assert _refusal(lambda: _native.gated_act(gate_up, act)) == message


@pytest.mark.parametrize("x, cos, sin, out, message", [
    (_XR.half(), _TABLE.half(), _TABLE.half(), _XR.half(), "rope: the native row kernels read fp32 or bf16, not "
                                                           "torch.float16"),
    (_XR[0], _TABLE[0], _TABLE[0], _XR[0], "rope: x must be [B, H, S, D] with an even D, got (2, 3, 4)"),
    (torch.zeros(1, 2, 3, 5), torch.zeros(1, 1, 3, 5), torch.zeros(1, 1, 3, 5), torch.zeros(1, 2, 3, 5),
     "rope: x must be [B, H, S, D] with an even D, got (1, 2, 3, 5)"),
    (_XR, _TABLE.double(), _TABLE.double(), _XR, "rope: cos and sin must match x"),
    (_XR, _TABLE, _TABLE.double(), _XR, "rope: cos and sin must match x"),
    (_XR, _TABLE, _TABLE, _XR[:, :1], "rope: out must match x"),
    (_XR, _TABLE, _TABLE, _XR.bfloat16(), "rope: out must match x"),
    (torch.zeros(1, 2, 4, 3).transpose(-1, -2), _TABLE, _TABLE, _XR, _ROPE_STRIDE),
    (_XR, torch.zeros(1, 1, 4, 3).transpose(-1, -2), _TABLE, _XR, _ROPE_STRIDE),
    (_XR, _TABLE, torch.zeros(1, 1, 4, 3).transpose(-1, -2), _XR, _ROPE_STRIDE),
    (_XR, _TABLE, _TABLE, torch.zeros(1, 2, 4, 3).transpose(-1, -2), _ROPE_STRIDE),
], ids=["x-dtype", "x-3d", "odd-d", "tables-dtype", "sin-dtype", "out-shape", "out-dtype", "x-strided",
        "cos-strided", "sin-strided", "out-strided"])
def test_the_native_rope_refuses_each_malformed_operand_by_name(x, cos, sin, out, message):
    assert _refusal(lambda: _native.rope(x, cos, sin, out)) == message
