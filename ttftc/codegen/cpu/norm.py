"""CPU lowering of ttftc.norm: residual add and RMSNorm/LayerNorm, in one pass per row on ttftc's native row kernel
(csrc/rows_kernel.h) where it is built and the dtypes are fp32/bf16, else with ATen's fused norm kernels.

RMSNorm keeps Hugging Face's numerics: in fp32, `torch.rms_norm` computes exactly the decomposition (statistics
and scaling in fp32, then the weight); for 16-bit inputs the normalised tensor is cast back before the weight
multiply, as HF does, which `torch.rms_norm` alone would not (it applies the weight in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttftc.codegen.cpu import _native
from ttftc.codegen.registry import register_lowering


def residual_add(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm's input, residual_out) for the op contract: residual_out is x + residual or an empty tensor."""
    if residual is None:
        return x, x.new_empty(0)
    summed = torch.add(x, residual)
    return summed, summed


def normalize_cpu(x: torch.Tensor, norm_w, norm_b, *, kind: str, eps: float) -> torch.Tensor:
    hidden = (x.shape[-1],)
    if kind == "layer":
        return F.layer_norm(x, hidden, norm_w, norm_b, eps)
    if x.dtype == torch.float32 and norm_w.dtype == torch.float32:
        return torch.rms_norm(x, hidden, norm_w, eps)
    normed = torch.rms_norm(x.float(), hidden, None, eps).to(x.dtype)
    return normed.mul_(norm_w) if torch.promote_types(x.dtype, norm_w.dtype) == x.dtype else norm_w * normed


def native_norm_fits(x: torch.Tensor, norm_w, norm_b, kind: str) -> bool:
    """Whether the native row kernel takes this norm (it reads fp32/bf16; LayerNorm's weight and bias in x's dtype)."""
    if _native.rows_reason(x) is not None or norm_w.dtype not in (torch.float32, x.dtype):
        return False
    if kind == "layer":
        return norm_b is not None and norm_w.dtype == norm_b.dtype == x.dtype
    return kind == "rms"


def native_norm_rows(x: torch.Tensor, norm_w, norm_b, residual):
    """The native row kernels' operands: x and residual as contiguous [rows, hidden], contiguous weight and bias."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    res = None if residual is None else residual.reshape(rows.shape).contiguous()
    return rows, norm_w.contiguous(), None if norm_b is None else norm_b.contiguous(), res


def native_residual_out(x: torch.Tensor, summed) -> torch.Tensor:
    """The ttftc.norm residual output from a native kernel's x + residual (None: no residual, an empty tensor)."""
    return x.new_empty(0) if summed is None else summed.view(x.shape)


def add_and_normalize(x: torch.Tensor, norm_w, norm_b, residual, *, kind: str, eps: float):
    """(normalised x + residual, residual_out): the ttftc.norm contract, one pass per row where the native kernel
    takes it."""
    if native_norm_fits(x, norm_w, norm_b, kind):
        normed, summed = _native.norm(*native_norm_rows(x, norm_w, norm_b, residual), layer=kind == "layer", eps=eps)
        return normed.view(x.shape), native_residual_out(x, summed)
    x, residual_out = residual_add(x, residual)
    return normalize_cpu(x, norm_w, norm_b, kind=kind, eps=eps), residual_out


def norm_reason(ctx, x, norm_w, norm_b=None, residual=None, *, kind, eps) -> str | None:
    if ctx.device_type != "cpu":
        return f"cpu provider, tensors on {ctx.device_type}"
    if kind not in ("rms", "layer"):
        return f"norm kind {kind!r}"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {x.dtype} not supported by the cpu norm path"
    if norm_w.dim() != 1 or norm_w.shape[0] != x.shape[-1]:
        return f"norm weight shape {tuple(norm_w.shape)} does not match hidden size {x.shape[-1]}"
    if norm_b is not None and (norm_b.dim() != 1 or norm_b.shape[0] != x.shape[-1]):
        return f"norm bias shape {tuple(norm_b.shape)} does not match hidden size {x.shape[-1]}"
    if kind == "layer" and norm_w.dtype != x.dtype:
        return f"layer norm weight dtype {norm_w.dtype} differs from input dtype {x.dtype}"
    # the native kernel takes eps as a C float: anything else would fail or be converted there, after the choice
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        return f"eps {eps!r} is not a finite non-negative number"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return "residual shape or dtype differs from the input"
    return None


@register_lowering("norm", "cpu", unsupported_reason=norm_reason)
def norm_cpu(x, norm_w, norm_b=None, residual=None, *, kind, eps):
    return add_and_normalize(x, norm_w, norm_b, residual, kind=kind, eps=eps)
