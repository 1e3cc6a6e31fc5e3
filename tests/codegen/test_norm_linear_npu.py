"""NPU lowerings of ttftc.norm and ttftc.norm_linear (npu_rms_norm, npu_add_rms_norm), against the recording
torch_npu stand-in."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TOLERANCES
from tests.npu_standin import npu_standin  # noqa: F401  (pytest fixture)
from ttftc.codegen.registry import LoweringContext, lowerings_for

FORCED = LoweringContext("cpu", "npu")
norm, norm_linear = torch.ops.ttftc.norm, torch.ops.ttftc.norm_linear


def _inputs(dtype, hidden=32, out=24):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 5, hidden, generator=g).to(dtype), torch.randn(1, 5, hidden, generator=g).to(dtype),
            (torch.rand(hidden, generator=g) + 0.5).to(dtype), (torch.randn(out, hidden, generator=g) * 0.2).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_linear_with_residual_uses_npu_add_rms_norm(npu_standin, dtype):
    from ttftc.codegen.npu.norm_linear import norm_linear_npu

    x, res, norm_w, w = _inputs(dtype)
    out, res_out = norm_linear_npu(x, norm_w, None, w, None, res, kind="rms", eps=1e-6)
    expected, expected_res = norm_linear(x, norm_w, None, w, None, res, kind="rms", eps=1e-6)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol * 4, rtol=rtol)
    torch.testing.assert_close(res_out, expected_res, atol=0, rtol=0)
    call = npu_standin.last("npu_add_rms_norm")
    assert call.shapes == {"x1": (1, 5, 32), "x2": (1, 5, 32), "gamma": (32,)}
    assert call.kwargs["epsilon"] == 1e-6


def test_norm_without_residual_uses_npu_rms_norm(npu_standin):
    from ttftc.codegen.npu.norm import norm_npu

    x, _, norm_w, _ = _inputs(torch.float32)
    y, res_out = norm_npu(x, norm_w, None, None, kind="rms", eps=1e-5)
    expected, _ = norm(x, norm_w, None, None, kind="rms", eps=1e-5)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert res_out.numel() == 0
    assert npu_standin.ops() == ["npu_rms_norm"]


def test_layer_norm_uses_the_native_op(npu_standin):
    from ttftc.codegen.npu.norm import norm_npu

    x, res, norm_w, _ = _inputs(torch.float32)
    norm_b = torch.zeros_like(norm_w)
    y, res_out = norm_npu(x, norm_w, norm_b, res, kind="layer", eps=1e-5)
    expected, expected_res = norm(x, norm_w, norm_b, res, kind="layer", eps=1e-5)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(res_out, expected_res)
    assert npu_standin.ops() == []


def test_capability_reasons(npu_standin):
    (entry,) = [e for e in lowerings_for("norm_linear") if e.provider == "npu"]
    x, res, norm_w, w = _inputs(torch.float32)
    assert entry.unsupported_reason(FORCED, x, norm_w, None, w, None, res, kind="rms", eps=1e-6) is None
    assert "gamma dtype" in entry.unsupported_reason(FORCED, x, norm_w.double(), None, w, kind="rms", eps=1e-6)
    assert "not npu" in entry.unsupported_reason(LoweringContext("cuda", None), x, norm_w, None, w, kind="rms",
                                                 eps=1e-6)
