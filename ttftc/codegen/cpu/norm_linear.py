"""CPU lowering of ttftc.norm_linear: the residual add and norm (cpu/norm.py: one native pass per row, or ATen's
fused norm), then the GEMM into the (merged) weight
with the backend cpu/_blas.py chooses (oneDNN by default; MKL in column blocks as an autotune alternative).
"""

from __future__ import annotations

from ttftc.autotune.space import SearchSpace, register_space
from ttftc.codegen.cpu._blas import (WIDE_GEMM_SPACE_AXES, cpu_linear_reason, default_wide_gemm_config, gemm_options,
                                     linear_2d, wide_gemm_constraint)
from ttftc.codegen.cpu._threads import honours_num_threads, with_thread_axis
from ttftc.codegen.cpu.norm import add_and_normalize, norm_reason
from ttftc.codegen.registry import register_lowering


def _reason(ctx, x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps):
    reason = norm_reason(ctx, x, norm_w, norm_b, residual, kind=kind, eps=eps)
    if reason is not None:
        return reason
    if norm_w.dtype != x.dtype:
        return f"norm weight dtype {norm_w.dtype} differs from input dtype {x.dtype} (GEMM would mix dtypes)"
    return cpu_linear_reason(ctx, x, w)


@register_lowering("norm_linear", "cpu", unsupported_reason=_reason)
@honours_num_threads
def norm_linear_cpu(x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps, tuning_config=None):
    normed, residual_out = add_and_normalize(x, norm_w, norm_b, residual, kind=kind, eps=eps)
    out = linear_2d(normed.reshape(-1, normed.shape[-1]), w, b, **gemm_options(tuning_config, x.dtype))
    return out.view(*x.shape[:-1], w.shape[0]), residual_out


register_space(with_thread_axis(SearchSpace("norm_linear", "cpu", axes=WIDE_GEMM_SPACE_AXES,
                                            default=default_wide_gemm_config, constraints=(wide_gemm_constraint,))))
