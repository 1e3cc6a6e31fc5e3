"""Shared test setup.

Triton decides between compiling and interpreting when a kernel is decorated, so TRITON_INTERPRET must be set
before any ttftc kernel module is imported: here, at collection time. On a machine without CUDA every Triton
kernel then runs on CPU tensors through the interpreter.
"""

import atexit
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Precision "auto" follows the CPU's native bf16; tests pin the answer so they decide the same on every machine
# (tests of the policy itself mock the probe both ways). Subprocesses inherit it.
os.environ["TTFTC_NATIVE_BF16"] = "0"

# Tests never read or write the user's caches: the compile and autotune caches live in a throw-away root,
# removed when the process that made it exits (not by forked children, such as mutmut's, that share it).
_CACHE_ROOT, _CACHE_OWNER = tempfile.mkdtemp(prefix="ttftc-test-cache-"), os.getpid()
os.environ["TTFTC_CACHE_DIR"] = _CACHE_ROOT
os.environ.pop("TTFTC_COMPILE_CACHE", None)
os.environ.pop("TTFTC_AUTOTUNE_CACHE", None)


@atexit.register
def _remove_cache_root():
    if os.getpid() == _CACHE_OWNER:
        shutil.rmtree(_CACHE_ROOT, ignore_errors=True)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Every test compiles models of the same classes; without a reset, Dynamo's per-code-object recompile
    # limit would silently turn later compiles into eager runs.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
