"""The start of a kernel_check compile worker, in a module that imports neither triton nor a kernel module.

Triton decides between compiling and interpreting when a function is decorated with @triton.jit, its own
triton.language helpers included, and under TRITON_INTERPRET=1 (how the tests run kernels on CPU) it builds
interpreter stand-ins that cannot be compiled. A worker process is spawned fresh and runs `start` before it
unpickles its first task, so kernel_check (and through it triton and the kernels) is imported only once the
variable is gone. `start` must therefore live here: the pool imports its module before running it.
"""

from __future__ import annotations

import os


def start() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
