"""CPU lowering of ttftc.linear: one GEMM with the backend cpu/_blas.py chooses (oneDNN by default)."""

from __future__ import annotations

from ttftc.autotune.space import SearchSpace, register_space
from ttftc.codegen.cpu._blas import (WIDE_GEMM_SPACE_AXES, cpu_linear_reason, default_wide_gemm_config, gemm_options,
                                     linear_2d, wide_gemm_constraint)
from ttftc.codegen.cpu._threads import honours_num_threads, with_thread_axis
from ttftc.codegen.registry import register_lowering


def _reason(ctx, x, w, b=None):
    reason = cpu_linear_reason(ctx, x, w)
    if reason is not None:
        return reason
    if w.shape[1] != x.shape[-1]:
        return f"weight {tuple(w.shape)} does not fit input width {x.shape[-1]}"
    if b is not None and (b.dim() != 1 or b.shape[0] != w.shape[0] or b.dtype != x.dtype):
        return f"bias of shape {tuple(b.shape)} / {b.dtype} does not fit [{w.shape[0]}] / {x.dtype}"
    return None


@register_lowering("linear", "cpu", unsupported_reason=_reason)
@honours_num_threads
def linear_cpu(x, w, b=None, *, tuning_config=None):
    out = linear_2d(x.reshape(-1, x.shape[-1]), w, b, **gemm_options(tuning_config, x.dtype))
    return out.view(*x.shape[:-1], w.shape[0])


register_space(with_thread_axis(SearchSpace("linear", "cpu", axes=WIDE_GEMM_SPACE_AXES, default=default_wide_gemm_config,
                                            constraints=(wide_gemm_constraint,))))
