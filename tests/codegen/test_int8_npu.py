"""NPU lowerings of W8A8 through the recording torch_npu stand-in: the calls made, their arguments, the numbers."""

from __future__ import annotations

import torch

import ttftc
from tests.helpers import compile_and_run, needs_transformers
from tests.npu_standin import npu_standin  # noqa: F401  (pytest fixture)
from ttftc import zoo
from ttftc.codegen.registry import LoweringContext
from ttftc.codegen.npu import int8_linear as npu_int8
from ttftc.ops.int8_linear import int8_linear, quantize_per_token

FORCED = LoweringContext(device_type="cpu", forced_provider="npu")


def test_int8_linear_calls_dynamic_quant_then_quant_matmul(npu_standin):
    x = torch.randn(1, 7, 64, dtype=torch.bfloat16)
    w, s = quantize_per_token(torch.randn(32, 64) * 0.1)
    bias = torch.randn(32)
    assert npu_int8._int8_linear_reason(FORCED, x, None, w, s, bias, out_dtype=torch.float32) is None
    out = npu_int8.int8_linear_npu(x, None, w, s, bias, out_dtype=torch.float32)
    assert npu_standin.ops() == ["npu_dynamic_quant", "npu_quant_matmul"]
    call = npu_standin.last("npu_quant_matmul")
    assert call.shapes["x1"] == (7, 64) and call.shapes["x2"] == (64, 32)
    assert call.shapes["pertoken_scale"] == (7,) and call.kwargs["output_dtype"] == torch.bfloat16
    expected = int8_linear.reference(x, None, w, s, bias, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=0.02 * expected.abs().max().item(), rtol=0)


def test_not_capable_without_torch_npu_or_off_npu(npu_standin):
    x = torch.randn(4, 64)
    w, s = quantize_per_token(torch.randn(32, 64))
    auto = LoweringContext(device_type="cpu", forced_provider=None)
    assert "npu" in npu_int8._int8_linear_reason(auto, x, None, w, s, None, out_dtype=torch.float32)


@needs_transformers
def test_int8_model_through_the_standin(npu_standin):
    model = zoo.build("llama", "sdpa")
    actual, expected, report = compile_and_run(model, zoo.example_ids(model, 20),
                                               ttftc.Config(precision="int8", provider="npu"))
    assert report.providers["int8_linear"] == {"npu": report.ops_after["ttftc.int8_linear"]}
    assert report.providers["gated_ffn_int8"] == {"npu": 2}
    assert report.providers["norm_quant"] == {"npu": 4}
    assert "npu_quant_matmul" in npu_standin.ops() and "npu_dynamic_quant" in npu_standin.ops()
    cos = torch.nn.functional.cosine_similarity(actual.double().flatten(), expected.double().flatten(), dim=0)
    assert cos >= 0.99
