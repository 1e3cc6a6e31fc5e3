"""Triton fused (residual add +) RMSNorm/LayerNorm kernel, alone (ttftc.norm) and feeding the GEMM
(ttftc.norm_linear), under the interpreter on CPU with tiny shapes."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TOLERANCES, needs_triton
from ttftc.codegen.registry import LoweringContext, lowerings_for

pytestmark = [needs_triton, pytest.mark.interpreter]

norm, norm_linear = torch.ops.ttftc.norm, torch.ops.ttftc.norm_linear
FORCED = LoweringContext("cpu", "triton")


def _inputs(dtype, kind, hidden=40, out=24, bias=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, hidden, generator=g).to(dtype)
    res = torch.randn(1, 5, hidden, generator=g).to(dtype)
    norm_w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    norm_b = torch.randn(hidden, generator=g).to(dtype) if kind == "layer" else None
    w = (torch.randn(out, hidden, generator=g) * 0.2).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    return x, res, norm_w, norm_b, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_kernel_matches_reference(dtype, kind, with_residual):
    from ttftc.codegen.triton.norm import norm_triton

    x, res, norm_w, norm_b, _, _ = _inputs(dtype, kind)
    res = res if with_residual else None
    y, res_out = norm_triton(x, norm_w, norm_b, res, kind=kind, eps=1e-6)
    # The reference runs in the same dtype (CPU torch has fp16/bf16 kernels): the kernel must reproduce its
    # rounding points (the residual sum, x·rstd before the RMSNorm weight) up to one rounding step.
    expected_y, expected_res = norm(x, norm_w, norm_b, res, kind=kind, eps=1e-6)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y, expected_y, atol=atol * 4, rtol=rtol)
    assert res_out.shape == expected_res.shape
    if with_residual:
        # Exact where the interpreter rounds like a GPU; its fp32 -> bf16 conversion may differ by one ulp.
        exact = dtype != torch.bfloat16
        torch.testing.assert_close(res_out, expected_res, atol=0 if exact else atol, rtol=0 if exact else rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_linear_matches_reference(dtype, kind):
    from ttftc.codegen.triton.norm_linear import norm_linear_triton

    x, res, norm_w, norm_b, w, b = _inputs(dtype, kind, bias=True)
    out, res_out = norm_linear_triton(x, norm_w, norm_b, w, b, res, kind=kind, eps=1e-5)
    fp32 = [t.float() if t is not None else None for t in (x, norm_w, norm_b, w, b, res)]
    expected, expected_res = norm_linear(*fp32, kind=kind, eps=1e-5)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol * 8, rtol=rtol * 4)
    torch.testing.assert_close(res_out.float(), expected_res, atol=atol, rtol=rtol)


def test_capability_reasons():
    from ttftc.codegen.triton.norm import MAX_HIDDEN

    (entry,) = [e for e in lowerings_for("norm_linear") if e.provider == "triton"]
    x, res, norm_w, _, w, _ = _inputs(torch.float32, "rms")
    assert entry.unsupported_reason(FORCED, x, norm_w, None, w, None, res, kind="rms", eps=1e-6) is None
    assert "cuda" in entry.unsupported_reason(LoweringContext("cpu", None), x, norm_w, None, w, kind="rms", eps=1e-6)
    wide = torch.empty(1, 2, MAX_HIDDEN + 1, device="meta")
    reason = entry.unsupported_reason(FORCED, wide, torch.empty(MAX_HIDDEN + 1, device="meta"), None,
                                      torch.empty(4, MAX_HIDDEN + 1, device="meta"), kind="rms", eps=1e-6)
    assert "exceeds" in reason
