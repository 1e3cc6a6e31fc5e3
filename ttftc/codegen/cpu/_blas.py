"""What the CPU lowerings share: one BLAS GEMM per linear, and the capability rule for it.

Weights stay in their frozen [N, K] layout and reach BLAS as the transposed view `w.t()` (transB), with no
compile-time copy: benchmarks/ffn_norm_cpu.py measured a contiguous [K, N] copy made at compile time against
the view at llama-135m shapes (512 tokens; K/N of 1024/3072, 1024/5632, 2816/1024) and found no difference
beyond noise (0.95x to 1.13x, in both directions, fp32 and bf16), while the copy would double the memory of
every weight it touched (the lm_head alone is 131 MB at 32k vocabulary).
"""

from __future__ import annotations

from typing import Optional

import torch


def linear_2d(x2d: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x2d · wᵀ (+ bias) for w stored [N, K], as one BLAS call."""
    return torch.addmm(bias, x2d, w.t()) if bias is not None else torch.mm(x2d, w.t())


def cpu_linear_reason(ctx, x, *weights) -> Optional[str]:
    """Shared capability check: CPU tensors, float dtypes BLAS handles, 2-D weights of x's dtype."""
    if ctx.device_type != "cpu":
        return f"cpu provider, tensors on {ctx.device_type}"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {x.dtype} not supported by the cpu GEMM path"
    for w in weights:
        if w.dim() != 2:
            return f"weight of rank {w.dim()} (want 2)"
        if w.dtype != x.dtype:
            return f"weight dtype {w.dtype} differs from activation dtype {x.dtype}"
    return None
