"""CPU lowerings of the W8A8 ops against their torch references (tiny shapes), with their glue (quantisation,
norm, dequantisation) on ttftc's native row kernels and on ATen."""

from __future__ import annotations

import pytest
import torch

import ttftc.ops  # noqa: F401
from tests.codegen.conftest import switch_native
from ttftc.codegen.cpu import int8_linear as cpu
from ttftc.codegen.cpu import norm as cpu_norm
from ttftc.codegen.registry import LoweringContext
from ttftc.ops.int8_linear import int8_linear, quantize_per_token
from ttftc.ops.quant import gated_ffn_int8, norm_quant

CPU = LoweringContext(device_type="cpu", forced_provider=None)


@pytest.fixture(autouse=True, params=["native", "aten"])
def glue(request, monkeypatch, pin_int8_gemm):
    """The glue on the native row kernels (the calls are recorded) and on ATen; None for ATen. Switching the
    native kernels off also takes the native GEMM away, so the measured choice is re-made without it (as on a
    machine whose measurement never saw it); tests that pin their own GEMM pin it after this."""
    calls = switch_native(monkeypatch, request.param, [cpu, cpu_norm],
                          ("quantize_rows", "norm_quant", "dequant", "gated_quant"))
    if request.param == "aten":
        pin_int8_gemm(cpu.int8_gemm_choice().without(cpu._unavailable_gemms()))
    return calls if request.param == "native" else None


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_per_token(torch.randn(n, k, generator=g) * 0.1)


@pytest.mark.parametrize("tokens", [5, 40, cpu.ROW_BLOCK + 37])  # below and across the row blocking
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_reference(tokens, out_dtype, each_int8_gemm):
    torch.manual_seed(0)
    x = torch.randn(1, tokens, 64)
    w, s = _weights(48, 64)
    bias = torch.randn(48)
    expected = int8_linear.reference(x, None, w, s, bias, out_dtype=out_dtype)
    actual = cpu.int8_linear_cpu(x, None, w, s, bias, out_dtype=out_dtype)
    assert actual.shape == expected.shape and actual.dtype == out_dtype
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def exact_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm's contract computed exactly: these tests count its calls, and must not depend on whether this
    CPU's _int_mm is exact (with oneDNN capped at AVX2 on a VNNI CPU it is not; the measured choice refuses it)."""
    return torch.mm(a.long(), b.long()).int()


def _counting_int_mm(monkeypatch) -> list:
    """The row count of every torch._int_mm call."""
    rows = []
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: rows.append(a.shape[0]) or exact_int_mm(a, b))
    return rows


def test_long_prompts_run_one_gemm_per_row_block(monkeypatch, pin_int8_gemm):
    pin_int8_gemm("int_mm")
    rows = _counting_int_mm(monkeypatch)
    tokens = 2 * cpu.ROW_BLOCK + 37
    x = torch.randn(tokens, 64)
    w, s = _weights(8, 64)
    actual = cpu.int8_linear_cpu(x, None, w, s, out_dtype=torch.float32)
    assert rows == [cpu.ROW_BLOCK, cpu.ROW_BLOCK, 37]  # the int32 scratch stays ROW_BLOCK rows
    torch.testing.assert_close(actual, int8_linear.reference(x, None, w, s, out_dtype=torch.float32))


def test_a_wide_input_with_few_tokens_is_one_gemm(monkeypatch, pin_int8_gemm):
    pin_int8_gemm("int_mm")
    rows = _counting_int_mm(monkeypatch)
    x = torch.randn(5, cpu.ROW_BLOCK + 88)  # the blocking counts tokens, not the input width
    w, s = _weights(8, cpu.ROW_BLOCK + 88)
    actual = cpu.int8_linear_cpu(x, None, w, s, out_dtype=torch.float32)
    assert rows == [5] and actual.shape == (5, 8)
    torch.testing.assert_close(actual, int8_linear.reference(x, None, w, s, out_dtype=torch.float32))


def test_int8_linear_with_prequantised_input():
    x = torch.randn(30, 64)
    q, scale = quantize_per_token(x)
    w, s = _weights(16, 64)
    expected = int8_linear.reference(q, scale, w, s, out_dtype=torch.float32)
    torch.testing.assert_close(cpu.int8_linear_cpu(q, scale, w, s, out_dtype=torch.float32), expected)


def _ran_native(glue, name):
    """With the native glue, that kernel ran (the ATen run has nothing to check)."""
    assert glue is None or name in glue, f"{name} did not run on the native kernel: {glue}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_is_bit_exact_with_the_reference(glue, dtype):
    x = (torch.randn(33, 100) * torch.linspace(0.01, 10, 33)[:, None]).to(dtype)
    x[4] = 0  # an all-zero row must not divide by zero
    q, scale = cpu.quantize_rows(x)
    q_ref, scale_ref = quantize_per_token(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    _ran_native(glue, "quantize_rows")


# LayerNorm's weight has the input's dtype (the capability check refuses the rest); RMSNorm's may be fp32.
NORM_DTYPES = [("rms", torch.float32, torch.float32), ("rms", torch.bfloat16, torch.bfloat16),
               ("rms", torch.bfloat16, torch.float32), ("layer", torch.float32, torch.float32),
               ("layer", torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("kind,dtype,weight_dtype", NORM_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("width", [64, 203])  # 203: a tail past the last full vector
def test_norm_quant_matches_reference(glue, kind, with_residual, dtype, weight_dtype, width):
    torch.manual_seed(1)
    x, residual = (torch.randn(2, 9, width) * 2).to(dtype), torch.randn(2, 9, width).to(dtype)
    norm_w = torch.randn(width).to(weight_dtype)
    norm_b = torch.randn(width).to(weight_dtype) if kind == "layer" else None
    res = residual if with_residual else None
    q, s, r = cpu.norm_quant_cpu(x, norm_w, norm_b, res, kind=kind, eps=1e-5)
    q_ref, s_ref, r_ref = norm_quant.reference(x, norm_w, norm_b, res, kind=kind, eps=1e-5)
    assert q.shape == q_ref.shape and s.shape == s_ref.shape == (2, 9)
    assert (q.int() - q_ref.int()).abs().max() <= 1  # fused-kernel rounding may move a tie by one step
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(r, r_ref, rtol=0, atol=0)
    _ran_native(glue, "norm_quant")


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens", [7, cpu.ROW_BLOCK + 3])
def test_gated_ffn_int8_matches_reference(glue, act, tokens, each_int8_gemm):
    torch.manual_seed(2)
    x = torch.randn(tokens, 64)
    w_gu, s_gu = _weights(2 * 96, 64, seed=3)
    w_d, s_d = _weights(64, 96, seed=4)
    expected = gated_ffn_int8.reference(x, None, w_gu, s_gu, w_d, s_d, act=act, out_dtype=torch.float32)
    actual = cpu.gated_ffn_int8_cpu(x, None, w_gu, s_gu, w_d, s_d, act=act,
                                    out_dtype=torch.float32)
    # The activation between the GEMMs is requantised; fp32 summation order can move a tie by one step there.
    torch.testing.assert_close(actual, expected, atol=2e-3 * expected.abs().max().item(), rtol=0)
    if each_int8_gemm == "int_mm":  # only the int32 accumulator feeds the fused native epilogue
        _ran_native(glue, "gated_quant")


def test_capability_checks_explain_refusals():
    x = torch.randn(4, 64)
    w, s = _weights(8, 64)
    assert cpu._int8_linear_reason(CPU, x, None, w, s, None, out_dtype=torch.float32) is None
    cuda = LoweringContext(device_type="cuda", forced_provider=None)
    assert "cuda" in cpu._int8_linear_reason(cuda, x, None, w, s, None, out_dtype=torch.float32)
    assert "int8" in cpu._int8_linear_reason(CPU, x, s[:4], w, s, None, out_dtype=torch.float32)
    assert "fit" in cpu._int8_linear_reason(CPU, torch.randn(4, 32), None, w, s, None, out_dtype=torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "relu"])
def test_gated_ffn_int8_with_biases_and_a_prequantised_input(out_dtype, act):
    torch.manual_seed(5)
    tokens = cpu.ROW_BLOCK + 9  # two row blocks, each with the biases
    x = torch.randn(1, tokens, 64)
    xq, xs = quantize_per_token(x)
    w_gu, s_gu = _weights(2 * 32, 64, seed=6)
    w_d, s_d = _weights(64, 32, seed=7)
    b_gu, b_d = torch.randn(64) * 0.5, torch.randn(64) * 0.5
    args = (xq, xs, w_gu, s_gu, w_d, s_d, b_gu, b_d)
    expected = gated_ffn_int8.reference(*args, act=act, out_dtype=out_dtype)
    actual = cpu.gated_ffn_int8_cpu(*args, act=act, out_dtype=out_dtype)
    assert actual.shape == (1, tokens, 64) and actual.dtype == out_dtype
    tol = 2e-3 if out_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol * expected.abs().max().item(), rtol=0)


def test_dequantisation_scales_rows_and_columns_then_adds_the_bias(glue):
    acc = torch.tensor([[10, -20, 30], [1, 2, 3]], dtype=torch.int32)
    x_scale, w_scale, bias = torch.tensor([0.5, 2.0]), torch.tensor([1.0, 0.1, 3.0]), torch.tensor([1.0, 2.0, 3.0])
    expected = acc.double() * x_scale.double()[:, None] * w_scale.double()[None, :] + bias.double()
    out = cpu.dequant_epilogue(acc, x_scale, w_scale, bias, torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected)
    assert cpu.dequant_epilogue(acc, x_scale, w_scale, None, torch.bfloat16).dtype == torch.bfloat16
    torch.testing.assert_close(cpu.dequant_epilogue(acc, x_scale, w_scale, None, torch.float32).double(),
                               expected - bias.double())
    _ran_native(glue, "dequant")


def test_quantize_rows_saturates_at_127_and_rounds_to_nearest():
    x = torch.tensor([[1.0, -1.0, 0.5, 0.25], [254.0, 1.0, -0.9, 127.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = cpu.quantize_rows(x)
    assert scale.tolist() == pytest.approx([1 / 127, 2.0, 1e-8 / 127])
    assert q.tolist() == [[127, -127, 64, 32], [127, 0, 0, 64], [0, 0, 0, 0]]
    assert q.dtype == torch.int8 and scale.dtype == torch.float32


def test_quantize_per_token_and_norm_quant_keep_the_token_shape():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    q, scale = cpu.quantize_per_token_cpu(x)
    q_ref, scale_ref = quantize_per_token(x)
    assert q.shape == (2, 3, 64) and scale.shape == (2, 3)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    q, s, r = cpu.norm_quant_cpu(x.float(), torch.ones(64), None, None, kind="rms", eps=1e-6)
    assert q.shape == (2, 3, 64) and s.shape == (2, 3) and r.numel() == 0


def test_int8_refusals_check_the_given_scale_the_gate_up_split_and_the_residual():
    x = torch.randn(4, 63)  # an odd width is fine: only the gate|up row count must split in two
    xq, xs = quantize_per_token(x)
    w_gu, s_gu = _weights(16, 63)
    w_d, s_d = _weights(63, 8)
    gated = dict(act="silu", out_dtype=torch.float32)
    assert cpu._gated_reason(CPU, x, None, w_gu, s_gu, w_d, s_d, **gated) is None
    assert cpu._gated_reason(CPU, xq, xs, w_gu, s_gu, w_d, s_d, **gated) is None
    assert cpu._gated_reason(CPU, x, xs, w_gu, s_gu, w_d, s_d, **gated) == (
        "activation is torch.float32 although a scale is given (want int8)")
    w_odd, s_odd = _weights(17, 63)  # 17 // 2 is w_down's width, but 17 rows have no gate|up halves
    assert cpu._gated_reason(CPU, x, None, w_odd, s_odd, w_d, s_d, **gated) == (
        "weights (17, 63) / (63, 8) do not form a gated FFN")
    tokens = torch.randn(2, 5, 63)  # the width is the last dim, not a batch dim
    assert cpu._int8_linear_reason(CPU, tokens, None, w_gu, s_gu, out_dtype=torch.float32) is None
    assert cpu._int8_linear_reason(CPU, tokens, None, w_d, s_d, out_dtype=torch.float32) == (
        "weight (63, 8) does not fit input width 63")
    norm_w = torch.ones(63)
    assert cpu._norm_quant_reason(CPU, x, norm_w, None, torch.randn(4, 63), kind="rms", eps=1e-6) is None
    for residual in (torch.randn(2, 63), torch.randn(4, 63, dtype=torch.bfloat16)):
        assert cpu._norm_quant_reason(CPU, x, norm_w, None, residual, kind="rms", eps=1e-6) == (
            "residual shape or dtype differs from the input")


def test_autotune_never_tries_a_gemm_refused_here(pin_int8_gemm):
    pin_int8_gemm("int_mm", refused={"onednn_u8": "no qlinear here"})
    assert cpu._refused_gemm_constraint({"gemm": "onednn_u8"}, None) == "no qlinear here"
    assert cpu._refused_gemm_constraint({"gemm": "int_mm"}, None) is None
    assert cpu._refused_gemm_constraint({"gemm": "fp32"}, None) is None


def test_only_the_u8_gemm_needs_onednns_quantised_linear(monkeypatch):
    monkeypatch.setattr(cpu, "onednn_u8_reason", lambda: "no qlinear here")
    monkeypatch.setattr(cpu, "native_int8_reason", lambda: None)
    assert cpu._unavailable_gemms() == {"onednn_u8": "no qlinear here"}
    monkeypatch.delattr(torch, "_int_mm")
    assert cpu._unavailable_gemms() == {"onednn_u8": "no qlinear here", "int_mm": "this torch has no torch._int_mm"}


def test_the_native_gemm_is_unavailable_without_the_extension_or_avx2(monkeypatch, glue):
    if glue is None:  # the lowerings see no native kernels at all
        assert cpu._unavailable_gemms()["native_avx2"] == "switched off by the test"
        return
    monkeypatch.setattr(cpu._native, "isa", lambda: "base")
    assert cpu._unavailable_gemms()["native_avx2"] == "the CPU lacks AVX2 (the native kernels run base)"


def test_every_capability_refusal_names_its_reason(monkeypatch):
    x = torch.randn(4, 64)
    w, s = _weights(8, 64)
    ok = dict(out_dtype=torch.float32)
    linear = cpu._int8_linear_reason
    assert linear(CPU, x.bfloat16(), None, w, s, torch.randn(8), **ok) is None
    assert linear(CPU, *quantize_per_token(x), w, s, **ok) is None
    assert "cannot be quantised" in linear(CPU, x.int(), None, w, s, **ok)
    assert "is not a 2-D int8 matrix" in linear(CPU, x, None, w.float(), s, **ok)
    assert "is not a 2-D int8 matrix" in linear(CPU, x, None, w[0], s, **ok)
    assert "weight scale shape (4,) is not [8]" in linear(CPU, x, None, w, s[:4], **ok)
    assert "weight scale shape" in linear(CPU, x, None, w, s[None], **ok)
    assert "bias shape (4,) is not [8]" in linear(CPU, x, None, w, s, torch.randn(4), **ok)
    assert "bias shape" in linear(CPU, x, None, w, s, torch.randn(1, 8), **ok)
    assert cpu._quantize_reason(CPU, x) is None and "cannot be quantised" in cpu._quantize_reason(CPU, x.long())
    norm_w = torch.ones(64)
    assert cpu._norm_quant_reason(CPU, x, norm_w, kind="rms", eps=1e-6) is None
    assert "hidden size" in cpu._norm_quant_reason(CPU, x, norm_w[:8], kind="rms", eps=1e-6)
    # the norm's own checks of its bias and eps, reached with each argument in its place
    assert "norm bias shape (8,)" in cpu._norm_quant_reason(CPU, x, norm_w, torch.zeros(8), kind="layer", eps=1e-6)
    assert "finite non-negative" in cpu._norm_quant_reason(CPU, x, norm_w, kind="rms", eps=float("nan"))
    assert "cannot be quantised" in cpu._norm_quant_reason(CPU, x.int(), norm_w, kind="rms", eps=1e-6)
    w_gu, s_gu = _weights(16, 64)
    w_d, s_d = _weights(64, 8)
    gated = dict(act="silu", out_dtype=torch.float32)
    assert cpu._gated_reason(CPU, x, None, w_gu, s_gu, w_d, s_d, **gated) is None
    assert "activation 'swish'" in cpu._gated_reason(CPU, x, None, w_gu, s_gu, w_d, s_d, act="swish",
                                                        out_dtype=torch.float32)
    assert "do not form a gated FFN" in cpu._gated_reason(CPU, x, None, w_gu[:-1], s_gu[:-1], w_d, s_d, **gated)
    assert "do not form a gated FFN" in cpu._gated_reason(CPU, x, None, w_gu, s_gu, w_d[:, :4], s_d, **gated)
    assert "weight scale shape" in cpu._gated_reason(CPU, x, None, w_gu, s_gu, w_d, s_d[:3], **gated)
    assert "bias shape" in cpu._gated_reason(CPU, x, None, w_gu, s_gu, w_d, s_d, torch.randn(3), **gated)
    assert "bias shape" in cpu._gated_reason(CPU, x, None, w_gu, s_gu, w_d, s_d, None, torch.randn(3), **gated)
    assert "is not a 2-D int8 matrix" in cpu._gated_reason(CPU, x, None, w_gu, s_gu, w_d.float(), s_d, **gated)
    assert "cuda" in cpu._gated_reason(LoweringContext("cuda", None), x, None, w_gu, s_gu, w_d, s_d, **gated)
    monkeypatch.delattr(torch, "_int_mm")
    assert linear(CPU, x, None, w, s, **ok) == "this torch has no torch._int_mm"


def _torch_with(available: bool, ops: tuple):
    """A stand-in for the torch module as onednn_u8_reason reads it: oneDNN available or not, and these ops
    (None: no torch.ops.onednn at all)."""
    from types import SimpleNamespace

    namespace = SimpleNamespace() if ops is None else SimpleNamespace(onednn=SimpleNamespace(**dict.fromkeys(ops, 1)))
    return SimpleNamespace(backends=SimpleNamespace(mkldnn=SimpleNamespace(is_available=lambda: available)),
                           ops=namespace)


@pytest.mark.parametrize("available, ops, reason", [
    (False, ("qlinear_prepack", "qlinear_pointwise"), "this torch build has no oneDNN"),
    (True, None, "this torch build has no torch.ops.onednn.qlinear_prepack"),
    (True, ("qlinear_prepack",), "this torch build has no torch.ops.onednn.qlinear_pointwise"),
    (True, ("qlinear_pointwise",), "this torch build has no torch.ops.onednn.qlinear_prepack"),
    (True, ("qlinear_prepack", "qlinear_pointwise"), None),
])
def test_the_onednn_int8_probe_names_what_the_build_lacks(monkeypatch, available, ops, reason):
    monkeypatch.setattr(cpu, "torch", _torch_with(available, ops))
    assert cpu.onednn_u8_reason.__wrapped__() == reason  # the uncached body


def test_the_int8_ffn_runs_row_blocks_of_at_most_row_block_rows_once_each(monkeypatch, pin_int8_gemm):
    pin_int8_gemm("int_mm")
    torch.manual_seed(2)
    tokens = 2 * cpu.ROW_BLOCK + 3
    x = torch.randn(tokens, 64)
    w_gu, s_gu = _weights(2 * 96, 64, seed=3)
    w_d, s_d = _weights(64, 96, seed=4)
    rows = []

    def counting_int_mm(a, b):
        rows.append(a.shape[0])
        return exact_int_mm(a, b)

    monkeypatch.setattr(torch, "_int_mm", counting_int_mm)
    actual = cpu.gated_ffn_int8_cpu(x, None, w_gu, s_gu, w_d, s_d, act="silu", out_dtype=torch.float32)
    blocks = [cpu.ROW_BLOCK, cpu.ROW_BLOCK, 3]
    assert rows == [n for n in blocks for _ in ("gate|up", "down")]  # each block: its gate|up GEMM, then its down
    monkeypatch.undo()
    expected = gated_ffn_int8.reference(x, None, w_gu, s_gu, w_d, s_d, act="silu", out_dtype=torch.float32)
    torch.testing.assert_close(actual, expected, atol=2e-3 * expected.abs().max().item(), rtol=0)
