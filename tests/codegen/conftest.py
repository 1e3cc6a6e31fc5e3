"""Fixtures shared by the codegen tests."""

from __future__ import annotations

import pytest
import torch

from ttftc.codegen.cpu import _native

NATIVE_ISAS = ("base", "avx2", "avx512", "avx512_bf16")


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


class NativeOff:
    """What a CPU lowering sees of ttftc.codegen.cpu._native where its kernels are not built."""

    ROW_DTYPES = _native.ROW_DTYPES
    ACTIVATION_CODES = _native.ACTIVATION_CODES

    @staticmethod
    def unavailable_reason():
        return "switched off by the test"

    @staticmethod
    def rows_reason(x):
        return "switched off by the test"

    @staticmethod
    def attention_reason(q, k, v):
        return "switched off by the test"


def switch_native(monkeypatch, mode: str, modules, kernels) -> list:
    """mode "native": the lowerings in `modules` keep the native kernels, and every call of one of `kernels` is
    recorded in the returned list; mode "aten": those modules see no native kernels. Where the kernels are not
    built, "native" skips (their absence fails test_attention_native_cpu.py on its own)."""
    if mode == "aten":
        for module in modules:
            monkeypatch.setattr(module, "_native", NativeOff)
        return []
    if _native.unavailable_reason() is not None:
        pytest.skip(_native.unavailable_reason())
    calls: list = []
    for name in kernels:
        real = getattr(_native, name)
        monkeypatch.setattr(_native, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    return calls


def record_linear_2d(monkeypatch, module) -> list:
    """Replace `module.linear_2d` by the real GEMM that also records each call's options ({"gemm", "n_block"})."""
    from ttftc.codegen.cpu._blas import linear_2d

    calls = []

    def record(x, w, b=None, n_block=0, *, gemm="blas"):
        calls.append({"gemm": gemm, "n_block": n_block})
        return linear_2d(x, w, b, n_block, gemm=gemm)

    monkeypatch.setattr(module, "linear_2d", record)
    return calls


GEMM_TUNINGS = [{"gemm": "blas", "n_block": 16}, {"gemm": "onednn", "n_block": 0}, None]  # None: the dtype's defaults


def fp32_gemm_options_or_skip(tuning) -> dict:
    """The GEMM options an fp32 lowering should pass for `tuning`; skips where this build cannot run the tuned one."""
    from ttftc.codegen.cpu._blas import gemm_options

    options = gemm_options(tuning, torch.float32)
    if tuning is not None and options["gemm"] != tuning["gemm"]:
        pytest.skip(f"this build cannot run {tuning}")
    return options
