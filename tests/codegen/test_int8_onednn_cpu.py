"""int8_linear's second CPU GEMM: oneDNN's quantised linear on packed weights with u8 activations."""

import gc

import pytest
import torch

from ttftc.autotune.space import Problem, space_for
from ttftc.codegen.cpu import int8_linear as cpu_int8
from ttftc.ops.int8_linear import quantize_per_token

pytestmark = pytest.mark.skipif(cpu_int8.onednn_u8_reason() is not None, reason=str(cpu_int8.onednn_u8_reason()))


def _operands(m=37, k=64, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w_q, w_s = quantize_per_token(w)
    return torch.randn(2, m, k, generator=g), w_q, w_s.float(), torch.randn(n, generator=g)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_u8_path_matches_int_mm(out_dtype, with_bias):
    x, w_q, w_s, bias = _operands()
    bias = bias if with_bias else None
    via_int_mm = cpu_int8.int8_linear_cpu(x, None, w_q, w_s, bias, out_dtype=out_dtype)
    via_u8 = cpu_int8.int8_linear_cpu(x, None, w_q, w_s, bias, out_dtype=out_dtype, tuning_config={"gemm": "onednn_u8"})
    assert via_u8.dtype == out_dtype and via_u8.shape == via_int_mm.shape
    # Both accumulate exactly in int32; only the order of the two fp32 scale multiplies may differ.
    torch.testing.assert_close(via_u8.float(), via_int_mm.float(), rtol=1e-5 if out_dtype == torch.float32 else 1e-2,
                               atol=1e-5 if out_dtype == torch.float32 else 1e-2)


def test_u8_path_takes_a_fused_producers_int8_input():
    x, w_q, w_s, bias = _operands()
    xq, xs = quantize_per_token(x)
    expected = cpu_int8.int8_linear_cpu(xq, xs, w_q, w_s, bias, out_dtype=torch.float32)
    actual = cpu_int8.int8_linear_cpu(xq, xs, w_q, w_s, bias, out_dtype=torch.float32, tuning_config={"gemm": "onednn_u8"})
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_a_weight_is_packed_once_and_released_with_it():
    packed = cpu_int8.PackedWeights()
    _, w_q, _, _ = _operands()
    first = packed.get(w_q, 37)
    assert packed.get(w_q, 512) is first
    del w_q, first
    gc.collect()
    assert len(packed._packed) == 0


def test_the_gemm_is_a_knob_with_int_mm_as_the_default():
    x, w_q, w_s, bias = _operands()
    space = space_for("int8_linear", "cpu", "cpu")
    problem = Problem.from_meta("int8_linear", "cpu", (x, None, w_q, w_s, bias), {"out_dtype": torch.float32})
    assert space.default(problem)["gemm"] == "int_mm"
    allowed, _ = space.candidates(problem)
    assert {c["gemm"] for c in allowed} == {"int_mm", "onednn_u8"}
