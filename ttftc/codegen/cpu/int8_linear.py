"""CPU lowerings of the W8A8 ops: ttftc.int8_linear, quantize_per_token, norm_quant and gated_ffn_int8.

The GEMM is `torch._int_mm` (oneDNN/MKL s8s8→s32; on CPU it takes any M, K, N), reading the [N, K] weight as
its transposed view: benchmarks/int8_cpu.py found a pre-transposed row-major [K, N] copy no faster (faster on
one llama-135m shape, slower on two), so there is no `prepare` step. The dequantisation runs as two passes over
the int32 accumulator (x int32·w_scale into a fresh fp32 buffer, then ·x_scale and +bias in place), in row
blocks of ROW_BLOCK tokens. benchmarks/int8_cpu.py measures these choices against fp32 and bf16 `mm`.
"""

from __future__ import annotations

import torch

from ttftc.autotune.space import SearchSpace, register_space
from ttftc.codegen.cpu._threads import honours_num_threads, with_thread_axis
from ttftc.codegen.cpu.ffn import activation_
from ttftc.codegen.cpu.norm import norm_reason, normalize_cpu, residual_add
from ttftc.codegen.lowering import register_lowering
from ttftc.ops.ffn import ACTIVATIONS

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Rows per GEMM + epilogue step. benchmarks/int8_cpu.py found no gain from small blocks (128 rows) at
# llama-135m widths, and each block adds thread-pool barriers that a shared machine punishes; 512-row blocks
# leave a 512-token prefill in one piece and still bound the int32 scratch of long prompts.
ROW_BLOCK = 512


def quantize_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row, with exactly the reference's arithmetic (ttftc.ops.int8_linear.quantize_per_token)."""
    xf = x2d.float()
    scale = xf.abs().amax(dim=-1).clamp_(min=1e-8).div_(127.0)
    q = torch.div(xf, scale.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequant_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    """acc[M, N] int32 → acc · x_scale[M, None] · w_scale[None, N] (+ bias) in out_dtype."""
    out = torch.mul(acc, w_scale)  # int32 · fp32 promotes to a fresh fp32 buffer in one pass
    out.mul_(x_scale.reshape(-1, 1))
    if bias is not None:
        out.add_(bias)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def int8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w_int8: torch.Tensor, w_scale, bias, out_dtype) -> torch.Tensor:
    """xq [M, K] int8, x_scale [M] → [M, N] out_dtype. Row-blocked so the epilogue reads a cached accumulator."""
    m, n = xq.shape[0], w_int8.shape[0]
    w_kn = w_int8.t()
    if m <= ROW_BLOCK:
        return dequant_epilogue(torch._int_mm(xq, w_kn), x_scale, w_scale, bias, out_dtype)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    for start in range(0, m, ROW_BLOCK):
        stop = min(m, start + ROW_BLOCK)
        acc = torch._int_mm(xq[start:stop], w_kn)
        out[start:stop] = dequant_epilogue(acc, x_scale[start:stop], w_scale, bias, torch.float32)
    return out


def _as_rows(x: torch.Tensor, x_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    x2d = x.reshape(-1, x.shape[-1])
    if x_scale is None:
        return quantize_rows(x2d)
    return x2d.contiguous(), x_scale.reshape(-1).float()


def _cpu_reason(ctx, x, x_scale) -> str | None:
    if ctx.device_type != "cpu":
        return f"cpu provider, tensors on {ctx.device_type}"
    if not hasattr(torch, "_int_mm"):
        return "this torch has no torch._int_mm"
    if x_scale is None and x.dtype not in FLOATS:
        return f"activation dtype {x.dtype} cannot be quantised"
    if x_scale is not None and x.dtype != torch.int8:
        return f"activation is {x.dtype} although a scale is given (want int8)"
    return None


def _weight_reason(x, w, s, bias=None) -> str | None:
    if w.dtype != torch.int8 or w.dim() != 2:
        return f"weight {tuple(w.shape)} {w.dtype} is not a 2-D int8 matrix"
    if w.shape[1] != x.shape[-1]:
        return f"weight {tuple(w.shape)} does not fit input width {x.shape[-1]}"
    if s.dim() != 1 or s.shape[0] != w.shape[0]:
        return f"weight scale shape {tuple(s.shape)} is not [{w.shape[0]}]"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.shape[0]):
        return f"bias shape {tuple(bias.shape)} is not [{w.shape[0]}]"
    return None


# -- int8_linear -------------------------------------------------------------------------------------------

def _int8_linear_reason(ctx, x, x_scale, w_int8, w_scale, bias=None, *, out_dtype):
    return _cpu_reason(ctx, x, x_scale) or _weight_reason(x, w_int8, w_scale, bias)


@register_lowering("int8_linear", "cpu", unsupported_reason=_int8_linear_reason)
@honours_num_threads
def int8_linear_cpu(x, x_scale, w_int8, w_scale, bias=None, *, out_dtype):
    xq, xs = _as_rows(x, x_scale)
    out = int8_gemm(xq, xs, w_int8, w_scale, bias, out_dtype)
    return out.view(*x.shape[:-1], w_int8.shape[0])


# The thread count is this lowering's only knob (cpu/_threads.py).
register_space(with_thread_axis(SearchSpace("int8_linear", "cpu", axes={}, default=lambda problem: {})))


# -- quantize_per_token --------------------------------------------------------------------------------------

def _quantize_reason(ctx, x):
    return _cpu_reason(ctx, x, None)


@register_lowering("quantize_per_token", "cpu", unsupported_reason=_quantize_reason)
def quantize_per_token_cpu(x):
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return q.view(x.shape), scale.view(x.shape[:-1])


# -- norm_quant ----------------------------------------------------------------------------------------------

def _norm_quant_reason(ctx, x, norm_w, norm_b=None, residual=None, *, kind, eps):
    return _cpu_reason(ctx, x, None) or norm_reason(ctx, x, norm_w, norm_b, residual, kind=kind, eps=eps)


@register_lowering("norm_quant", "cpu", unsupported_reason=_norm_quant_reason)
def norm_quant_cpu(x, norm_w, norm_b=None, residual=None, *, kind, eps):
    x, residual_out = residual_add(x, residual)
    normed = normalize_cpu(x, norm_w, norm_b, kind=kind, eps=eps)
    q, scale = quantize_rows(normed.reshape(-1, x.shape[-1]))
    return q.view(x.shape), scale.view(x.shape[:-1]), residual_out


# -- gated_ffn_int8 ------------------------------------------------------------------------------------------

def _gated_reason(ctx, x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None, *,
                  act, out_dtype):
    reason = _cpu_reason(ctx, x, x_scale) or _weight_reason(x, w_gate_up, gate_up_scale, b_gate_up)
    if reason is not None:
        return reason
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    if w_gate_up.shape[0] % 2 or w_gate_up.shape[0] // 2 != w_down.shape[1]:
        return f"weights {tuple(w_gate_up.shape)} / {tuple(w_down.shape)} do not form a gated FFN"
    return _weight_reason(x.new_empty(1, w_down.shape[1]), w_down, down_scale, b_down)


@register_lowering("gated_ffn_int8", "cpu", unsupported_reason=_gated_reason)
def gated_ffn_int8_cpu(x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None, *,
                       act, out_dtype):
    xq, xs = _as_rows(x, x_scale)
    inter = w_gate_up.shape[0] // 2
    out = torch.empty(xq.shape[0], w_down.shape[0], dtype=out_dtype, device=x.device)
    # One row block runs the whole FFN (gate|up GEMM, act·mul, quantise, down GEMM): long prompts never hold
    # more than ROW_BLOCK rows of the [tokens, 2I] intermediates.
    for start in range(0, xq.shape[0], ROW_BLOCK):
        stop = min(xq.shape[0], start + ROW_BLOCK)
        gate_up = dequant_epilogue(torch._int_mm(xq[start:stop], w_gate_up.t()), xs[start:stop], gate_up_scale,
                                   b_gate_up, torch.float32)
        h = activation_(gate_up[:, :inter], act).mul_(gate_up[:, inter:])
        hq, hs = quantize_rows(h)
        out[start:stop] = dequant_epilogue(torch._int_mm(hq, w_down.t()), hs, down_scale, b_down, out_dtype)
    return out.view(*x.shape[:-1], w_down.shape[0])
