"""The Triton ttftc.rope kernel under the interpreter on CPU, against the op's reference (tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from tests.codegen.rope_cases import rope_inputs
from tests.helpers import needs_triton
from ttftc.codegen.registry import LoweringContext

pytestmark = [needs_triton, pytest.mark.interpreter]

FORCED = LoweringContext("cpu", "triton")
TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=0, rtol=0)}


def assert_within_bf16_roundings(y, x, cos, sin, expected):
    """The interpreter rounds fp32 -> bf16 toward zero whatever rounding mode a kernel asks for (a GPU rounds to
    nearest, as ATen does): each of the two products and the sum may be one bf16 ulp (2^-7 relative) off."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1).float()
    bound = 2 ** -7 * ((x.float() * cos.float()).abs() + (rotated * sin.float()).abs() + expected.float().abs())
    excess = (y.float() - expected.float()).abs() - bound
    assert excess.max() <= 0, f"off by more than three bf16 roundings: worst excess {excess.max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,seq", [(40, 21), (64, 16), (6, 3)])  # partial and whole position blocks
def test_matches_the_reference(dtype, head_dim, seq):
    from ttftc.codegen.triton.rope import rope_triton
    from ttftc.ops.rope import empty_rope_output, rotate_half_reference

    x, cos, sin = rope_inputs(dtype, head_dim=head_dim, seq=seq, cos_batch=2)
    y = rope_triton(x, cos, sin)
    # the decomposition's layout: [B, S, H, D] in memory, like x
    assert y.shape == x.shape and y.dtype == dtype
    assert y.stride() == empty_rope_output(x, cos).stride() == (3 * head_dim * seq, head_dim, 3 * head_dim, 1)
    expected = rotate_half_reference(x, cos, sin)
    if dtype == torch.bfloat16:
        assert_within_bf16_roundings(y, x, cos, sin, expected)
    else:
        torch.testing.assert_close(y, expected, **TOLERANCE[dtype])


def test_capability_follows_device_and_shape(monkeypatch):
    from ttftc.codegen.triton.rope import MAX_HEAD_DIM, rope_reason

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, cos, sin = rope_inputs(torch.float32)
    assert rope_reason(FORCED, x, cos, sin) is None
    assert "triton needs cuda" in rope_reason(LoweringContext("cpu", None), x, cos, sin)
    wide = torch.empty(1, 1, 2, MAX_HEAD_DIM + 2)
    assert "limit" in rope_reason(FORCED, wide, wide, wide)
    assert "does not broadcast" in rope_reason(FORCED, x, cos[..., :4, :], sin)
