"""ttftc's native int8 GEMM (csrc/int8_gemm_kernel.h, candidate "native_avx2"): exact against torch._int_mm on every
instruction-set version this CPU runs (AVX2's sign trick, and the baseline's scalar loop), refused where it cannot
run, chosen where it beats fp32, and a whole int8 model through it."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from tests.codegen.conftest import native_isas_here
from ttftc.codegen.cpu import _native
from ttftc.codegen.cpu import int8_linear as cpu
from ttftc.codegen.cpu.int8_gemm_choice import FP32, choose, exactness_reason, full_range_operands
from ttftc.ops.int8_linear import int8_linear, quantize_per_token

pytestmark = pytest.mark.skipif(_native.unavailable_reason() is not None,
                                reason=f"native kernels: {_native.unavailable_reason()}")

NATIVE = cpu.NATIVE
# M, K, N off every tile size: M=1, M and N not multiples of the 4-row / 8-column register tile, K not a multiple of
# the 4-byte group (nor of 32), and one shape that spans several work items.
SHAPES = [(1, 1, 1), (1, 7, 3), (3, 4, 8), (5, 33, 9), (17, 130, 77), (64, 256, 64), (37, 1001, 40), (130, 96, 200)]


def _exact(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The exact int32 product, in int64 (torch._int_mm is not exact everywhere: under oneDNN capped at AVX2 on a
    VNNI CPU, the closest emulation of an AVX2 CPU, it saturates as the u8 GEMM does)."""
    return (xq.long() @ w.long().t()).int()


def _layouts(w: torch.Tensor):
    """The two layouts the int8 lowerings hand over: row-major [N, K], and a transposed view (GPT-2's Conv1D)."""
    return {"row-major": w, "transposed view": w.t().contiguous().t()}


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_the_int32_product_is_int_mms_bit_for_bit_on_every_isa(native_isa, m, k, n):
    xq, w = full_range_operands(max(m, 3), k, max(n, 3), seed=m + k + n)  # its extreme rows need 3 of each
    xq, w = xq[:m].clone(), w[:n]
    xq[-1, ::2] = -128  # the one activation whose |x| needs the u8 side's ninth bit
    for layout, weight in _layouts(w).items():
        out = _native.int8_gemm(xq, _native.pack_int8_weight(weight), n)
        assert out.dtype == torch.int32 and torch.equal(out, _exact(xq, w)), (native_isa, layout)


def test_each_isa_runs_its_own_version_of_the_gemm(native_isa):
    # VNNI's vpdpbusd only under the AVX-512 ISAs of a CPU that has it; forcing AVX2 reaches the AVX2 kernel.
    expected = {"base": "base", "avx2": "avx2"}.get(native_isa, _native.int8_gemm_isa())
    assert _native.int8_gemm_isa() == expected and expected in ("base", "avx2", "avx512_vnni")


def test_the_largest_pair_sums_do_not_saturate(native_isa):
    # |x| = 128 against 127 of one sign, and 127 against -127: pair sums of +-32512 and -32258, the extremes the
    # 16-bit vpmaddubsw sums reach, over a K long enough to sum many of them.
    k = 1024
    xq = torch.tensor([[-128] * k, [127] * k, [-127] * k, [-128, 127] * (k // 2)], dtype=torch.int8)
    w = torch.tensor([[127] * k, [-127] * k, [127, -127] * (k // 2)] * 3, dtype=torch.int8)
    assert torch.equal(_native.int8_gemm(xq, _native.pack_int8_weight(w), w.shape[0]), _exact(xq, w))


@pytest.mark.parametrize("block_rows, block_vecs", [(1, 1), (3, 1), (5, 3), (64, 32)])
def test_every_work_item_split_gives_the_same_product(block_rows, block_vecs):
    xq, w = full_range_operands(45, 72, 70, seed=3)
    out = _native.int8_gemm(xq, _native.pack_int8_weight(w), 70, block_rows=block_rows, block_vecs=block_vecs)
    assert torch.equal(out, _exact(xq, w))


def test_strided_activation_rows_are_read_in_place():
    xq, w = full_range_operands(20, 96, 24, seed=4)
    wide = torch.zeros(20, 130, dtype=torch.int8)
    wide[:, 5:101] = xq
    out = _native.int8_gemm(wide[:, 5:101], _native.pack_int8_weight(w), 24)
    assert torch.equal(out, _exact(xq, w))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_fused_dequantisation_rounds_as_atens(native_isa, out_dtype, with_bias):
    xq, w = full_range_operands(29, 70, 45, seed=5)
    g = torch.Generator().manual_seed(5)
    x_scale, w_scale, bias = torch.rand(29, generator=g), torch.rand(45, generator=g), torch.randn(45, generator=g)
    bias = bias if with_bias else None
    out = _native.int8_gemm(xq, _native.pack_int8_weight(w), 45, x_scale, w_scale, bias, out_dtype)
    expected = _exact(xq, w) * w_scale  # ATen's epilogue: every product and sum rounded to fp32 on its own
    expected.mul_(x_scale[:, None])
    if bias is not None:
        expected.add_(bias)
    assert out.dtype == out_dtype and torch.equal(out, expected.to(out_dtype))


def test_the_packer_refuses_minus_128_and_the_lowering_runs_such_a_weight_exactly():
    xq, w = full_range_operands(9, 40, 16, seed=6)
    w[3, 7] = -128
    with pytest.raises(ValueError, match="-128"):
        _native.pack_int8_weight(w)
    ones = torch.ones(9), torch.ones(16)
    with pytest.warns(RuntimeWarning, match="holds -128"):
        out = cpu.native_int8_gemm(xq, ones[0], w, ones[1], None, torch.float32)
    assert torch.equal(out, _exact(xq, w).float())


def test_the_wrapper_checks_what_it_hands_over():
    xq, w = full_range_operands(4, 12, 10)
    packed = _native.pack_int8_weight(w)
    assert tuple(packed.shape) == (2, 3, 8, 4)
    with pytest.raises(ValueError, match="packed must be"):
        _native.int8_gemm(xq, packed, 17)
    with pytest.raises(ValueError, match="packed must be"):
        _native.int8_gemm(xq[:, :8], packed, 10)
    with pytest.raises(ValueError, match="xq must be int8"):
        _native.int8_gemm(xq.float(), packed, 10)
    with pytest.raises(ValueError, match="needs both scales"):
        _native.int8_gemm(xq, packed, 10, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="scales"):
        _native.int8_gemm(xq, packed, 10, torch.ones(3), torch.ones(10), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="block_rows"):
        _native.int8_gemm(xq, packed, 10, block_rows=0)
    assert _native.int8_gemm(xq[:0], packed, 10).shape == (0, 10)


def _operator_case(**changes) -> dict:
    """Valid arguments of torch.ops.ttftc_native.int8_gemm (a dequantised fp32 [4, 10] product), some replaced."""
    xq, w = full_range_operands(4, 12, 10)
    args = dict(x=xq, packed=_native.pack_int8_weight(w), x_scale=torch.ones(4), w_scale=torch.ones(10), bias=None,
                out=torch.empty(4, 10), block_rows=64, block_vecs=2, threads=1)
    return {**args, **changes}


# The former int-tuple entry point's overflow cases (a row stride or a depth whose byte offsets pass int64, a
# negative depth) cannot occur through the operator: a tensor's sizes are non-negative, its strides and bytes fit its
# storage.
@pytest.mark.parametrize("changes, message", [
    (dict(block_vecs=0), "blocks"),
    (dict(block_rows=-(2**62)), "blocks"),
    (dict(x=torch.zeros(12, 4, dtype=torch.int8).t()), "unit stride"),
    (dict(x=torch.zeros(4, 12)), "x must be int8"),
    (dict(packed=_native.pack_int8_weight(torch.zeros(10, 16, dtype=torch.int8))), "packed must be"),
    (dict(packed=torch.zeros(3, 2, 8, 4, dtype=torch.int8).transpose(0, 1)), "packed must be"),
    (dict(w_scale=torch.ones(9)), "scales"),
    (dict(bias=torch.ones(10)[::2]), "scales"),
    (dict(out=torch.empty(4, 10, dtype=torch.int32), x_scale=None, w_scale=None, bias=torch.ones(10)), "no bias"),
    (dict(out=torch.empty(10, 4).t()), "out must be contiguous"),
    (dict(out=torch.empty(3, 10)), "out must be contiguous"),
])
def test_the_operator_refuses_what_its_kernel_cannot_read_or_write(changes, message):
    args = _operator_case(**changes)
    with pytest.raises(ValueError, match=message):
        torch.ops.ttftc_native.int8_gemm(**args)


def test_a_weight_is_packed_once_per_process():
    w, _ = quantize_per_token(torch.randn(24, 40))
    first = cpu.NATIVE_PACKED.get(w, 5)
    assert cpu.NATIVE_PACKED.get(w, 512) is first


# -- the candidate: exact, refused where it cannot run, chosen where it is fastest -----------------------------

def test_the_candidate_passes_the_choices_exactness_check_on_every_isa(native_isa):
    assert exactness_reason(cpu.native_int8_gemm) is None


def test_the_candidate_is_refused_without_avx2_or_the_extension(monkeypatch):
    previous = _native.set_isa("base")
    try:
        assert cpu._unavailable_gemms()[NATIVE] == "the CPU lacks AVX2 (the native kernels run base)"
    finally:
        _native.set_isa(previous)
    monkeypatch.setattr(_native, "unavailable_reason", lambda: "native kernels not built (test)")
    assert cpu._unavailable_gemms()[NATIVE] == "native kernels not built (test)"


@pytest.mark.parametrize("ms, chosen", [
    # An AVX2 CPU without VNNI (_int_mm a plain loop, the u8 GEMM saturating): fp32 and native_avx2 as an AMD EPYC
    # (Zen 5) measured them with every kernel capped at AVX2 (one thread), _int_mm as issue 29's Zen 3 did.
    ({FP32: 5.3, "int_mm": 420.0, NATIVE: 3.2}, NATIVE),
    # The native GEMM slower than fp32 (a CPU with slow byte multiplies): fp32 stays.
    ({FP32: 5.3, "int_mm": 420.0, NATIVE: 6.0}, FP32),
])
def test_an_avx2_cpu_chooses_the_native_gemm_where_it_beats_fp32(ms, chosen):
    choice = choose(ms, {"onednn_u8": "differs from the exact int32 product"}, (256, 1024, 1024))
    assert choice.gemm == chosen and choice.usable(NATIVE) == (chosen == NATIVE)


def test_the_choice_here_measured_the_native_gemm(measured_int8_gemm):
    choice = measured_int8_gemm()
    assert NATIVE in choice.ms or NATIVE in choice.refused
    assert (NATIVE in choice.refused) == (cpu.native_int8_reason() is not None)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_linear_through_the_native_gemm_matches_the_reference(out_dtype, pin_int8_gemm):
    pin_int8_gemm(NATIVE)
    torch.manual_seed(0)
    x = torch.randn(2, 19, 72)
    w, s = quantize_per_token(torch.randn(50, 72) * 0.1)
    bias = torch.randn(50)
    for weight in _layouts(w).values():
        actual = cpu.int8_linear_cpu(x, None, weight, s, bias, out_dtype=out_dtype)
        expected = int8_linear.reference(x, None, w, s, bias, out_dtype=out_dtype)
        assert actual.dtype == out_dtype
        torch.testing.assert_close(actual, expected)


@pytest.fixture
def avx2_forced():
    """The native kernels forced down to AVX2 (an AVX2 CPU without VNNI) for one test."""
    if "avx2" not in native_isas_here():
        pytest.skip("this CPU does not run the avx2 kernels")
    previous = _native.set_isa("avx2")
    yield
    _native.set_isa(previous)


def test_a_tiny_int8_model_through_the_native_gemm_agrees_with_fp32(monkeypatch, pin_int8_gemm, avx2_forced):
    pytest.importorskip("transformers")
    import ttftc
    from ttftc import zoo

    assert _native.int8_gemm_isa() == "avx2"
    pin_int8_gemm(NATIVE, {"onednn_u8": "differs from the exact int32 product"})
    calls = []
    real = _native.int8_gemm
    monkeypatch.setattr(_native, "int8_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(torch, "_int_mm", lambda *a: pytest.fail("torch._int_mm called instead of native_avx2"))
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 12)
    compiled = ttftc.compile(model, ttftc.Config(precision="int8", codegen="eager", buckets=None))
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no weight fell back for holding -128
        expected = model(ids).logits[:, -1]
        actual = compiled(ids).logits[:, -1]
    assert calls, "the native GEMM never ran"
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(actual, expected, atol=0.05 * float(expected.abs().max()), rtol=0)


def test_the_environment_forces_the_native_isa_for_a_whole_process():
    if _native.unavailable_reason() is not None:
        pytest.skip(_native.unavailable_reason())
    probe = "from ttftc.codegen.cpu import _native; print(_native.isa(), _native.int8_gemm_isa(), _native.unavailable_reason())"
    for forced in ("avx2", "base"):
        run = subprocess.run([sys.executable, "-c", probe], env={**os.environ, _native.ISA_ENV: forced},
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.split() == [forced, forced, "None"]
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], env={**os.environ, _native.ISA_ENV: "avx9"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "TTFTC_NATIVE_ISA='avx9': unknown instruction set avx9" in run.stdout
