"""`ttftc autotune --cpu`: measure this machine's CPU choices again and overwrite its record.

Every process reuses the choices kept per machine (codegen/cpu/measured.py); this is how a user measures them
again on purpose: after a BIOS or kernel update, a move to other cores, or a measurement taken under load.
"""

from __future__ import annotations

import torch

from ttftc import capabilities
from ttftc.codegen.cpu import _blas, attention, int8_linear, measured

DTYPES = (torch.float32, torch.bfloat16)


def remeasure() -> tuple[str, list[str]]:
    """(the store's path, one line per choice) after forgetting this machine's record and measuring every choice."""
    path = measured.forget()
    for cached in (int8_linear.int8_gemm_choice, _blas.measured_gemm_backend, _blas.measured_decode_backend,
                   attention.kernel_measurement, capabilities.bf16_gemm_measurement,
                   capabilities.measured_bf16_attention_speedup, capabilities.probe):
        cached.cache_clear()
    lines = [int8_linear.int8_gemm_choice().describe()]
    for dtype in DTYPES:
        lines += [_blas.measured_gemm_backend(dtype).describe(), _blas.measured_decode_backend(dtype).describe(),
                  attention.describe_kernel_choice(dtype)]
    lines.append(capabilities.probe("cpu").describe())
    return str(path), lines
