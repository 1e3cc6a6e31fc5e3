"""Triton lowering of ttftc.rope: one program per block of positions of one (batch, head), written in the op's
layout (the decomposition's: see ttftc/ops/rope.py).

Each program loads the low and high halves of its rows of x, and the matching halves of cos and sin (a broadcast
dimension is read with stride 0), and writes both halves of y. Products are rounded to x's dtype before the sum,
as the decomposition rounds them; arithmetic is fp32 (the interpreter has no bf16 arithmetic).
"""

from __future__ import annotations

from typing import Optional

import torch

from ttftc.codegen.registry import register_lowering
from ttftc.codegen.triton._ffn_norm_support import HAS_TRITON, device_reason, dtype_reason
from ttftc.codegen.triton.launch import KernelLaunch
from ttftc.ops.rope import empty_rope_output, rope_fake, rope_shape_reason

BLOCK_S = 16  # positions per program: 16 rows of a head dim up to 256 keep every tile in registers
MAX_HEAD_DIM = 512

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_kernel(
        x_ptr, cos_ptr, sin_ptr, y_ptr,
        heads, seq, half,
        x_sb, x_sh, x_ss, cos_sb, cos_sh, cos_ss, sin_sb, sin_sh, sin_ss, y_sb, y_sh, y_ss,
        BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        pid_s = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = tl.arange(0, BLOCK_HALF)
        mask = (rows[:, None] < seq) & (cols[None, :] < half)
        x_row = x_ptr + b * x_sb + h * x_sh + rows[:, None] * x_ss + cols[None, :]
        cos_row = cos_ptr + b * cos_sb + h * cos_sh + rows[:, None] * cos_ss + cols[None, :]
        sin_row = sin_ptr + b * sin_sb + h * sin_sh + rows[:, None] * sin_ss + cols[None, :]
        low_in = tl.load(x_row, mask=mask, other=0.0)
        dtype = low_in.dtype
        low = low_in.to(tl.float32)
        high = tl.load(x_row + half, mask=mask, other=0.0).to(tl.float32)
        cos_low = tl.load(cos_row, mask=mask, other=0.0).to(tl.float32)
        cos_high = tl.load(cos_row + half, mask=mask, other=0.0).to(tl.float32)
        sin_low = tl.load(sin_row, mask=mask, other=0.0).to(tl.float32)
        sin_high = tl.load(sin_row + half, mask=mask, other=0.0).to(tl.float32)
        # Each product as the decomposition stores it: rounded to x's dtype (to nearest even on GPUs), then summed.
        y_low = (low * cos_low).to(dtype).to(tl.float32) - (high * sin_low).to(dtype).to(tl.float32)
        y_high = (high * cos_high).to(dtype).to(tl.float32) + (low * sin_high).to(dtype).to(tl.float32)
        y_row = y_ptr + b * y_sb + h * y_sh + rows[:, None] * y_ss + cols[None, :]
        tl.store(y_row, y_low.to(dtype), mask=mask)
        tl.store(y_row + half, y_high.to(dtype), mask=mask)


def rope_reason(ctx, x, cos, sin) -> Optional[str]:
    reason = device_reason(ctx) or dtype_reason(x, cos, sin) or rope_shape_reason(x, cos, sin)
    if reason is not None:
        return reason
    if x.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {x.shape[-1]} exceeds the rope kernel's limit {MAX_HEAD_DIM}"
    if any(t.stride(-1) != 1 for t in (x, cos, sin)):
        return "the head dimension is not innermost in memory"
    return None


def rope_config(head_dim: int) -> dict:
    """The launch's constexprs and options for a head dim (no search space: one config per size class)."""
    return {"BLOCK_S": BLOCK_S, "BLOCK_HALF": max(16, 1 << (head_dim // 2 - 1).bit_length()), "num_warps": 4}


def rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, y: torch.Tensor) -> KernelLaunch:
    """The launch for x [B, H, S, D] (cos, sin broadcastable to it) into y (any strides, unit along D)."""
    b, h, s, d = x.shape
    cos, sin, config = cos.expand(x.shape), sin.expand(x.shape), rope_config(d)
    return KernelLaunch(
        _rope_kernel, (triton.cdiv(s, BLOCK_S), b * h),
        (x, cos, sin, y, h, s, d // 2, *x.stride()[:3], *cos.stride()[:3], *sin.stride()[:3], *y.stride()[:3]),
        {k: v for k, v in config.items() if k != "num_warps"}, {"num_warps": config["num_warps"]},
    )


@register_lowering("rope", "triton", unsupported_reason=rope_reason, priority=10, fake=rope_fake)
def rope_triton(x, cos, sin):
    y = empty_rope_output(x, cos)
    if y.numel():
        rope_launch(x, cos, sin, y).run()
    return y
