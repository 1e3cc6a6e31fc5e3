"""Fixtures shared by the codegen tests."""

from __future__ import annotations

import pytest

from ttftc.codegen.cpu import _native

NATIVE_ISAS = ("base", "avx2", "avx512")


def native_isas_here() -> list[str]:
    """The versions of the native kernels this CPU can run (none where they are not built)."""
    best = _native.isa()
    return list(NATIVE_ISAS[: NATIVE_ISAS.index(best) + 1]) if best else []


@pytest.fixture(params=NATIVE_ISAS)
def native_isa(request):
    """Runs the test once per instruction-set version of the native kernels that this CPU can run."""
    if request.param not in native_isas_here():
        pytest.skip(f"this CPU does not run the {request.param} kernels")
    previous = _native.set_isa(request.param)
    yield request.param
    _native.set_isa(previous)
