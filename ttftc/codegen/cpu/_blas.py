"""What the CPU lowerings share: the BLAS GEMM of a linear (column-blocked for wide merged weights), and the
capability rule for it.

Weights stay in their frozen [N, K] layout and reach BLAS as the transposed view `w.t()` (transB), with no
compile-time copy: benchmarks/ffn_norm_cpu.py measured a contiguous [K, N] copy made at compile time against
the view at llama-135m shapes (512 tokens; K/N of 1024/3072, 1024/5632, 2816/1024) and found no difference
beyond noise (0.95x to 1.13x, in both directions, fp32 and bf16), while the copy would double the memory of
every weight it touched (the lm_head alone is 131 MB at 32k vocabulary).
"""

from __future__ import annotations

from typing import Optional

import torch


# Output columns per BLAS call for the merged (wide) weights of the fused ops. On the 2-core AMD EPYC this project
# is measured on, one GEMM over a merged weight was slower than the separate GEMMs it replaced, and 1024-column
# blocks written into one output buffer were the fastest (benchmarks/wide_gemm_cpu.py, 512 tokens, K=1024:
# q|k|v 17.9 ms merged, 17.1 separate, 16.9 blocked; gate|up 34.6 merged, 31.7 separate, 31.2 blocked).
# 0 disables blocking. Autotunable per op instance (`WIDE_GEMM_SPACE_AXES`).
DEFAULT_N_BLOCK = 1024
WIDE_GEMM_SPACE_AXES = {"n_block": (0, 512, 1024, 2048)}


def linear_2d(x2d: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], n_block: int = 0) -> torch.Tensor:
    """x2d · wᵀ (+ bias) for w stored [N, K]: one BLAS call, or one per `n_block` output columns into one buffer
    (each writes its column slice in place: BLAS takes the row stride as ldc, so nothing is copied)."""
    n = w.shape[0]
    if n_block <= 0 or n <= n_block:
        return torch.addmm(bias, x2d, w.t()) if bias is not None else torch.mm(x2d, w.t())
    out = torch.empty(x2d.shape[0], n, dtype=x2d.dtype, device=x2d.device)
    for start in range(0, n, n_block):
        stop = min(n, start + n_block)
        if bias is not None:
            torch.addmm(bias[start:stop], x2d, w[start:stop].t(), out=out[:, start:stop])
        else:
            torch.mm(x2d, w[start:stop].t(), out=out[:, start:stop])
    return out


def n_block_of(tuning_config: Optional[dict]) -> int:
    return int((tuning_config or {}).get("n_block", DEFAULT_N_BLOCK))


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
