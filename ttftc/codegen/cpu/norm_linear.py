"""CPU lowering of ttftc.norm_linear: the fused ATen norm (cpu/norm.py), then the GEMM into the (merged) weight,
in column blocks of one output buffer (see _blas.DEFAULT_N_BLOCK for why blocks, not one wide GEMM).
"""

from __future__ import annotations

from ttftc.autotune.space import SearchSpace, register_space
from ttftc.codegen.cpu._blas import DEFAULT_N_BLOCK, WIDE_GEMM_SPACE_AXES, cpu_linear_reason, linear_2d, n_block_of
from ttftc.codegen.cpu.norm import norm_reason, normalize_cpu, residual_add
from ttftc.codegen.lowering import register_lowering


def _reason(ctx, x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps):
    reason = norm_reason(ctx, x, norm_w, norm_b, residual, kind=kind, eps=eps)
    if reason is not None:
        return reason
    if norm_w.dtype != x.dtype:
        return f"norm weight dtype {norm_w.dtype} differs from input dtype {x.dtype} (GEMM would mix dtypes)"
    return cpu_linear_reason(ctx, x, w)


@register_lowering("norm_linear", "cpu", unsupported_reason=_reason)
def norm_linear_cpu(x, norm_w, norm_b, w, b=None, residual=None, *, kind, eps, tuning_config=None):
    x, residual_out = residual_add(x, residual)
    normed = normalize_cpu(x, norm_w, norm_b, kind=kind, eps=eps)
    out = linear_2d(normed.reshape(-1, normed.shape[-1]), w, b, n_block_of(tuning_config))
    return out.view(*x.shape[:-1], w.shape[0]), residual_out


register_space(SearchSpace("norm_linear", "cpu", axes=WIDE_GEMM_SPACE_AXES,
                           default=lambda p: {"n_block": DEFAULT_N_BLOCK}))
