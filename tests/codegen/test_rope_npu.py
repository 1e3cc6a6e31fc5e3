"""The NPU lowering of ttftc.rope (torch_npu.npu_rotary_mul), against the recording torch_npu stand-in."""

from __future__ import annotations

import pytest
import torch

from tests.codegen.rope_cases import rope_inputs
from tests.helpers import TOLERANCES
from tests.npu_standin import npu_standin  # noqa: F401  (pytest fixture)
from ttftc.codegen.registry import LoweringContext

FORCED = LoweringContext("cpu", "npu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_calls_npu_rotary_mul_on_bnsd_and_keeps_the_ops_layout(npu_standin, dtype):
    from ttftc.codegen.npu.rope import rope_npu
    from ttftc.ops.rope import empty_rope_output, rotate_half_reference

    x, cos, sin = rope_inputs(dtype)
    y = rope_npu(x, cos, sin)
    assert y.stride() == empty_rope_output(x, cos).stride()  # the op's layout, whatever npu_rotary_mul returns
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y, rotate_half_reference(x, cos, sin), atol=atol, rtol=rtol)
    call = npu_standin.last("npu_rotary_mul")
    assert call.shapes == {"input": (2, 3, 11, 40), "r1": (1, 1, 11, 40), "r2": (1, 1, 11, 40)}
    assert call.tensors["input"].is_contiguous() and call.kwargs == {"rotary_mode": "half"}


def test_refuses_what_npu_rotary_mul_documents_as_unsupported(npu_standin):
    from ttftc.codegen.npu.rope import rope_reason

    x, cos, sin = rope_inputs(torch.float32)
    assert rope_reason(FORCED, x, cos, sin) is None
    wide = torch.empty(1, 1, 2, 896)
    assert "896" in rope_reason(FORCED, wide, wide, wide)
    many = torch.empty(1, 1000, 2, 8)
    assert "1000" in rope_reason(FORCED, many, many[:, :1], many[:, :1])
    assert "neither 1 nor" not in (rope_reason(FORCED, *rope_inputs(torch.float32, cos_batch=2, cos_heads=3)) or "")
    assert "every batch row" in rope_reason(FORCED, *rope_inputs(torch.float32, cos_batch=1, cos_heads=3))
    assert "not npu" in rope_reason(LoweringContext("cpu", None), x, cos, sin)


def test_without_torch_npu_the_lowering_is_incapable():
    from ttftc.codegen.npu.rope import rope_reason

    assert rope_reason(FORCED, *rope_inputs(torch.float32)) == "torch_npu is not importable"
