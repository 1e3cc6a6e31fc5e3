"""glibc malloc set up for prefill on CPU: freed activation memory is kept and reused, not returned to the kernel.

A prefill allocates activations of megabytes each (a 2048-token gate|up GEMM output of Llama-shaped models is
25-46 MiB) and frees them a layer later. glibc serves blocks above its mmap threshold (dynamic, at most 32 MiB)
with a fresh mmap and unmaps them on free, and trims the heap top above its trim threshold, so the next layer's
buffer of the same size is fresh memory again: every 4 KiB page is zero-filled by the kernel on its first touch,
which shows as minor page faults and system time in every forward (benchmarks/README.md, CPU memory).

`keep_freed_pages()` turns glibc's mmap use off (M_MMAP_MAX 0: every block comes from the heap, where a freed block
is reused) and raises the trim threshold to its maximum, once per process. The cost is that a process keeps the
peak of its heap: memory freed after a long prompt stays with it for the next one, as PyTorch's caching allocators
do on GPUs. TTFTC_CPU_MALLOC=system keeps glibc's defaults. Other C libraries are left alone (the call says so).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD_MAX = 2**31 - 1  # mallopt takes an int
OPT_OUT_VARIABLE = "TTFTC_CPU_MALLOC"


@functools.cache
def keep_freed_pages() -> str:
    """Set glibc malloc up once (see the module docstring) and say what was done, for the explain report."""
    if os.environ.get(OPT_OUT_VARIABLE, "").strip().lower() == "system":
        return f"malloc: glibc defaults kept ({OPT_OUT_VARIABLE}=system)"
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        return f"malloc: left as it is (C library {libc_name or 'unknown'}, not glibc)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        return f"malloc: left as it is (mallopt unavailable: {exc})"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_MAX)):
        return "malloc: left as it is (glibc refused the mallopt settings)"
    return ("malloc: freed activation memory is reused, not unmapped (glibc mmap off, trim threshold 2 GiB; "
            f"{OPT_OUT_VARIABLE}=system keeps the defaults)")
