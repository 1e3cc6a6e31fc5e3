"""A source checkout on a machine with a C++ compiler has its native kernels built, not silently skipped.

The extension is optional for users (no compiler: the lowerings take their ATen paths), but an install that quietly
skipped it (pip's isolated build has no torch to compile the operators against) would leave every native-kernel
test skipping and CI green. Here, where the sources and a compiler are both present, a missing module is a failure
that names the fix.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ttftc.codegen.cpu import _native

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(not (ROOT / "setup.py").exists() or shutil.which("c++") is None,
                    reason="not a source checkout with a C++ compiler: the native kernels are optional")
def test_a_checkout_with_a_compiler_has_built_its_native_kernels():
    assert _native.unavailable_reason() is None, (
        f"{_native.unavailable_reason()}; build them with torch importable: "
        "python3 -m pip install --no-build-isolation -e .")
    assert _native.isa() in ("avx512_bf16", "avx512", "avx2", "base")
