"""Capability rules shared by the Triton norm, norm_linear and FFN lowerings.

Triton runs on CUDA. On CPU it runs only through the interpreter (TRITON_INTERPRET=1) and only when the caller
forced provider="triton": that is how tests push whole models through the kernels. The interpreter simulates
kernels with numpy, which has no bf16 arithmetic, so the kernels load every tile and cast it to fp32 before any
arithmetic (on GPUs too: norms need fp32 statistics anyway) and feed `tl.dot` fp32 tiles when interpreting.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # ImportError, or a triton whose backend fails at import
    HAS_TRITON = False

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def device_reason(ctx) -> Optional[str]:
    if not HAS_TRITON:
        return "triton is not importable"
    if ctx.device_type == "cuda":
        return None
    if ctx.device_type == "cpu" and ctx.forced_provider == "triton" and ctx.triton_interpret:
        return None
    return f"triton needs cuda tensors (or cpu with provider='triton' under TRITON_INTERPRET=1), got {ctx.device_type}"


def dtype_reason(*tensors: Optional[torch.Tensor]) -> Optional[str]:
    for t in tensors:
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            return f"dtype {t.dtype} not supported by the triton kernels (fp32, fp16, bf16)"
    return None


def interpreting(x: torch.Tensor) -> bool:
    return x.device.type == "cpu"
