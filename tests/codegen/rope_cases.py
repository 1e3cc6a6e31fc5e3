"""Inputs shared by the ttftc.rope lowering tests: q sliced out of a merged q|k|v GEMM output, as in a model."""

from __future__ import annotations

import torch


def rope_inputs(dtype: torch.dtype, *, batch: int = 2, heads: int = 3, seq: int = 11, head_dim: int = 40,
                cos_batch: int = 1, cos_heads: int = 1):
    """(x, cos, sin): x is [B, H, S, D] read from a [B, S, (H + 2) * D] buffer (rows H*D apart, not contiguous)."""
    g = torch.Generator().manual_seed(head_dim * 31 + seq)
    qkv = torch.randn(batch, seq, (heads + 2) * head_dim, generator=g).to(dtype)
    x = qkv[..., : heads * head_dim].view(batch, seq, heads, head_dim).transpose(1, 2)
    angles = torch.rand(cos_batch, cos_heads, seq, head_dim, generator=g) * 6.0
    return x, angles.cos().to(dtype), angles.sin().to(dtype)
