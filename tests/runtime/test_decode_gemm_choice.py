"""The eager batched decode runs its GEMMs on the backend measured at a decode shape on this machine (issue 41:
it was forced to oneDNN for one CPU). Each CPU class's choice is asserted with its timings injected."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ttftc.codegen.cpu import _blas
from ttftc.runtime import engine


@pytest.fixture
def decode_backend(monkeypatch):
    """`set(onednn_us, blas_us)`: the decode GEMM measured with these times (µs per call), nothing stored."""
    monkeypatch.delenv(_blas.GEMM_BACKEND_ENV, raising=False)
    monkeypatch.setattr(_blas, "onednn_reason", lambda dtype: None)

    def set_times(onednn_us: float, blas_us: float) -> _blas.GemmBackendChoice:
        _blas.measured_decode_backend.cache_clear()
        times = {"onednn": onednn_us / 1e3, "blas": blas_us / 1e3}
        monkeypatch.setattr(_blas, "_backend_ms", lambda backend, dtype, shape, *a: times[backend])
        return _blas.measured_decode_backend(torch.float32)

    yield set_times
    _blas.measured_decode_backend.cache_clear()


@pytest.mark.parametrize("cpu_class, onednn_us, blas_us, backend", [
    ("MKL's sgemm on a slow path at a few rows", 80.0, 400.0, "onednn"),
    ("MKL fast at a few rows, oneDNN's call costs more", 400.0, 90.0, "blas"),
    ("a near-tie goes to the fixed order, not to the noise", 100.0, 103.0, "blas"),
])
def test_the_decode_gemm_is_the_one_measured_faster_at_a_decode_shape(decode_backend, cpu_class, onednn_us,
                                                                        blas_us, backend):
    choice = decode_backend(onednn_us, blas_us)
    assert choice.backend == backend, cpu_class
    assert choice.shape == _blas.DECODE_SHAPE and choice.describe().startswith(f"fp32 decode GEMM: {backend} (")
    context = engine._decode_gemms(torch.float32, torch.device("cpu"))
    assert isinstance(context, engine._OneDnnLinear if backend == "onednn" else contextlib.nullcontext)


def test_the_decode_gemm_follows_the_override_and_skips_what_onednn_cannot_run(decode_backend, monkeypatch):
    decode_backend(80.0, 400.0)
    monkeypatch.setenv(_blas.GEMM_BACKEND_ENV, "blas")
    _blas.measured_decode_backend.cache_clear()
    assert isinstance(engine._decode_gemms(torch.float32, torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(engine._decode_gemms(torch.float16, torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(engine._decode_gemms(torch.float32, torch.device("meta")), contextlib.nullcontext)


def test_the_real_decode_measurement_times_both_backends_where_both_run():
    choice = _blas.measured_decode_backend(torch.float32)
    assert choice.backend in _blas.GEMM_BACKENDS
    if not choice.reason:
        assert set(choice.ms) == set(_blas.GEMM_BACKENDS) and all(t > 0 for t in choice.ms.values())
