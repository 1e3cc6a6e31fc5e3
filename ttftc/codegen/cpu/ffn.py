"""CPU lowerings of ttftc.gated_ffn and ttftc.linear_act: GEMMs (cpu/_blas.py) with the activation between them.

gated_ffn: one GEMM into [T, 2I] for the merged gate|up weight, then act(gate)·up in one pass per row into a
contiguous [T, I] (ttftc's native row kernel, csrc/rows_kernel.h), which the down GEMM reads as it is. Without the
native kernel: act(gate) and the multiply by up run in place on the gate half (no new [T, I] buffers), and the down
GEMM reads that half as a strided view (BLAS takes the row stride as its leading dimension; oneDNN copies it once,
see cpu/_blas.py). Weight layout: see cpu/_blas.py. It measured faster than the eager three GEMMs + silu + mul at
llama-135m shapes (benchmarks/ffn_norm_cpu.py; figures and CPU in benchmarks/README.md, FFN and norms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttftc.autotune.space import SearchSpace, register_space
from ttftc.codegen.cpu import _native
from ttftc.codegen.cpu._blas import (WIDE_GEMM_SPACE_AXES, cpu_linear_reason, default_wide_gemm_config, gemm_options,
                                     linear_2d, wide_gemm_constraint)
from ttftc.codegen.cpu._threads import honours_num_threads, with_thread_axis
from ttftc.codegen.registry import register_lowering
from ttftc.ops.ffn import ACTIVATIONS


def activation_(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(x) in place: x is a buffer this lowering owns."""
    if act == "silu":
        return F.silu(x, inplace=True)
    if act == "gelu_tanh":
        return torch.ops.aten.gelu_(x, approximate="tanh")
    if act == "gelu":
        return torch.ops.aten.gelu_(x)
    if act == "relu":
        return x.relu_()
    raise ValueError(f"Unknown activation {act!r}; valid: {ACTIVATIONS}")


def _bias_reason(x, bias, n) -> str | None:
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.dtype != x.dtype):
        return f"bias of shape {tuple(bias.shape)} / {bias.dtype} does not fit [{n}] / {x.dtype}"
    return None


def _gated_reason(ctx, x, w_gate_up, w_down, b_gate_up=None, b_down=None, *, act):
    reason = cpu_linear_reason(ctx, x, w_gate_up, w_down)
    if reason is not None:
        return reason
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    if w_gate_up.shape[0] % 2 or w_gate_up.shape[0] // 2 != w_down.shape[1] or w_gate_up.shape[1] != x.shape[-1]:
        return f"weights {tuple(w_gate_up.shape)} / {tuple(w_down.shape)} do not form a gated FFN"
    return _bias_reason(x, b_gate_up, w_gate_up.shape[0]) or _bias_reason(x, b_down, w_down.shape[0])


@register_lowering("gated_ffn", "cpu", unsupported_reason=_gated_reason)
@honours_num_threads
def gated_ffn_cpu(x, w_gate_up, w_down, b_gate_up=None, b_down=None, *, act, tuning_config=None):
    inter = w_gate_up.shape[0] // 2
    gemm = gemm_options(tuning_config, x.dtype)
    gate_up = linear_2d(x.reshape(-1, x.shape[-1]), w_gate_up, b_gate_up, **gemm)
    if act in _native.ACTIVATION_CODES and _native.rows_reason(gate_up) is None:
        hidden = _native.gated_act(gate_up, act)
    else:
        hidden = activation_(gate_up[:, :inter], act).mul_(gate_up[:, inter:])
    out = linear_2d(hidden, w_down, b_down, gemm=gemm["gemm"])
    return out.view(*x.shape[:-1], w_down.shape[0])


def _linear_act_reason(ctx, x, w, b=None, *, act):
    reason = cpu_linear_reason(ctx, x, w)
    if reason is not None:
        return reason
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    if w.shape[1] != x.shape[-1]:
        return f"weight {tuple(w.shape)} does not fit input width {x.shape[-1]}"
    return _bias_reason(x, b, w.shape[0])


@register_lowering("linear_act", "cpu", unsupported_reason=_linear_act_reason)
@honours_num_threads
def linear_act_cpu(x, w, b=None, *, act, tuning_config=None):
    out = activation_(linear_2d(x.reshape(-1, x.shape[-1]), w, b, **gemm_options(tuning_config, x.dtype)), act)
    return out.view(*x.shape[:-1], w.shape[0])


for _op in ("gated_ffn", "linear_act"):
    register_space(with_thread_axis(SearchSpace(_op, "cpu", axes=WIDE_GEMM_SPACE_AXES, default=default_wide_gemm_config,
                                                constraints=(wide_gemm_constraint,))))
