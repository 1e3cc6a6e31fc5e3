"""The CPU lowering of ttftc.rope: the native kernel (csrc/rope_kernel.h) against the op's reference, on every
instruction-set version this CPU runs."""

from __future__ import annotations

import pytest
import torch

from tests.codegen.rope_cases import rope_inputs
from ttftc.codegen.cpu import _native
from ttftc.codegen.cpu.rope import rope_cpu, rope_reason
from ttftc.codegen.registry import LoweringContext
from ttftc.ops.rope import empty_rope_output, rotate_half_reference

pytestmark = pytest.mark.skipif(_native.unavailable_reason() is not None, reason=str(_native.unavailable_reason()))

CPU = LoweringContext("cpu", None)
# fp32: the kernel may fuse a product into the sum (one rounding fewer); bf16 rounds each product as eager does.
EXACTNESS = {torch.float32: dict(atol=2e-6, rtol=1e-6), torch.bfloat16: dict(atol=0, rtol=0)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [6, 64, 80, 136])  # a half below one vector, whole vectors, tails
def test_matches_the_reference_on_strided_queries(native_isa, dtype, head_dim):
    x, cos, sin = rope_inputs(dtype, head_dim=head_dim)
    y = rope_cpu(x, cos, sin)
    # the decomposition's layout: [B, S, H, D] in memory, like x
    assert y.shape == x.shape and y.dtype == dtype
    assert y.stride() == empty_rope_output(x, cos).stride() == (3 * head_dim * 11, head_dim, 3 * head_dim, 1)
    torch.testing.assert_close(y, rotate_half_reference(x, cos, sin), **EXACTNESS[dtype])


@pytest.mark.parametrize("cos_batch,cos_heads", [(2, 1), (2, 3), (1, 3)])
def test_cos_and_sin_broadcast_along_batch_and_heads(native_isa, cos_batch, cos_heads):
    x, cos, sin = rope_inputs(torch.float32, cos_batch=cos_batch, cos_heads=cos_heads)
    torch.testing.assert_close(rope_cpu(x, cos, sin), rotate_half_reference(x, cos, sin), **EXACTNESS[torch.float32])


def test_cos_and_sin_may_broadcast_differently(native_isa):
    x, cos, sin = rope_inputs(torch.float32, cos_batch=2, cos_heads=3)
    sin = sin[:1, :1]  # one sin table for every batch row and head, while cos has one per head
    torch.testing.assert_close(rope_cpu(x, cos, sin), rotate_half_reference(x, cos, sin), **EXACTNESS[torch.float32])


def test_position_and_batch_pick_their_own_rows_of_cos_and_sin():
    # A kernel that read cos[0] for every position, or batch 0's tables for every batch row, gives x itself for
    # row 0 only: each position and batch row here has its own rotation.
    x = torch.ones(2, 1, 4, 2)
    angles = torch.arange(8, dtype=torch.float32).view(2, 1, 4, 1).expand(2, 1, 4, 2) * 0.5
    y = rope_cpu(x, angles.cos(), angles.sin())
    expected = torch.stack((angles.cos()[..., 0] - angles.sin()[..., 0], angles.cos()[..., 1] + angles.sin()[..., 1]),
                           dim=-1)
    torch.testing.assert_close(y, expected)


def test_an_empty_sequence_gives_an_empty_result():
    x, cos, sin = rope_inputs(torch.float32, seq=0)
    assert rope_cpu(x, cos, sin).shape == (2, 3, 0, 40)


def test_refusals_name_the_problem():
    x, cos, sin = rope_inputs(torch.float32)
    assert rope_reason(CPU, x.half(), cos.half(), sin.half()) is not None  # the kernel reads fp32 and bf16
    assert "dtypes differ" in rope_reason(CPU, x, cos.double(), sin)
    assert "odd" in rope_reason(CPU, x[..., :39], cos[..., :39], sin[..., :39])
    assert "does not broadcast" in rope_reason(CPU, x, cos[..., :5, :], sin)
    assert "tensors on cuda" in rope_reason(LoweringContext("cuda", None), x, cos, sin)
    assert rope_reason(CPU, x, cos, sin) is None
    d_major = x.permute(0, 3, 2, 1).contiguous().permute(0, 3, 2, 1)
    assert rope_reason(CPU, d_major, cos, sin) == "the head dimension is not innermost in memory"
    with pytest.raises(ValueError, match="unit stride"):
        _native.rope(x, cos.transpose(-1, -2).contiguous().transpose(-1, -2), sin, empty_rope_output(x, cos))
