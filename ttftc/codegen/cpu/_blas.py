"""What the CPU lowerings share: the GEMM of a linear, its two backends, and the capability rule for it.

Two GEMM backends compute x · wᵀ for a weight stored [N, K]:
  "onednn"  oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`). It writes a fresh output, so it takes no column
            blocking, and it copies a row-strided activation to contiguous first (measured no slower than writing
            the gated FFN's act·mul into a fresh buffer instead).
  "blas"    `torch.mm`/`torch.addmm` (MKL), optionally in column blocks written into one output buffer: with this
            backend one GEMM over a merged weight measured slower than the separate GEMMs it replaced, and 1024-column
            blocks fastest (hence DEFAULT_N_BLOCK).
Both are autotune knobs per op instance (`WIDE_GEMM_SPACE_AXES`). Without a tuned config, the default is whichever
of the two measured faster on this machine (`measured_gemm_backend`, one llama-sized GEMM each, kept per machine
by measured.py): the ranking depends on the CPU (MKL takes a different code path on each vendor), so no machine's
ranking is baked in. The eager batched decode's GEMMs (a few rows each) are measured apart, at a decode shape
(`measured_decode_backend`): the ranking at a handful of rows need not be the prefill's.
benchmarks/wide_gemm_cpu.py measures both; benchmarks/README.md (GEMM backend) has the figures and their CPUs.
$TTFTC_CPU_GEMM (onednn or blas) overrides both measurements.

Weights stay in their frozen [N, K] layout and reach the GEMM as-is (oneDNN) or as the transposed view `w.t()`
(BLAS transB), with no compile-time copy: a contiguous [K, N] copy measured no faster at llama-135m shapes
(benchmarks/ffn_norm_cpu.py) and would double the memory of every weight it touched.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from ttftc.codegen.cpu.measured import Provenance, checked_times, prefer, recall

GEMM_BACKENDS = ("onednn", "blas")
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
DEFAULT_N_BLOCK = 1024  # for the "blas" backend only
WIDE_GEMM_SPACE_AXES = {"gemm": GEMM_BACKENDS, "n_block": (0, 512, 1024, 2048)}
# Overrides the measured default backend: for a machine where the measurement misleads, and for tests.
GEMM_BACKEND_ENV = "TTFTC_CPU_GEMM"
# The timed GEMM: a 256-token prompt through a 1024 x 1024 projection (llama-135m's hidden size), the same shape the
# int8 GEMM choice times: large enough that the GEMM, not the call, is timed, a few ms at most per call.
TIMED_SHAPE = (256, 1024, 1024)
# The decode GEMM's timed shape: 8 requests' rows through the same projection. Each call is microseconds, so one
# sample is _DECODE_CALLS calls, the best of _DECODE_REPEATS samples counted.
DECODE_SHAPE = (8, 1024, 1024)
_DECODE_CALLS, _DECODE_REPEATS = 20, 5
_REPEATS = 3
# The near-tie order (measured.prefer): BLAS is what ATen runs without ttftc, so a tie keeps the default path.
PREFERENCE = ("blas", "onednn")


@functools.cache  # a property of the build and the CPU; every GEMM call asks (gemm_options)
def onednn_reason(dtype: torch.dtype) -> Optional[str]:
    """None when the oneDNN GEMM can run this dtype on this build, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if dtype not in ONEDNN_DTYPES:
        return f"oneDNN GEMM path covers {[str(d) for d in ONEDNN_DTYPES]}, not {dtype}"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no native bf16 for oneDNN"
    return None


@dataclass(frozen=True)
class GemmBackendChoice:
    """The default CPU GEMM backend for one dtype, and the measurements (or the reason) behind it."""

    dtype: torch.dtype
    backend: str
    ms: Mapping[str, float] = field(default_factory=dict)  # backend -> best of _REPEATS, where timed
    reason: str = ""  # why nothing was timed (an override, or only one backend can run)
    shape: tuple[int, int, int] = TIMED_SHAPE
    provenance: Optional[Provenance] = field(default=None, compare=False)  # measured now or loaded, and when
    role: str = "GEMM"  # "GEMM" (prefill and compiled graphs) or "decode GEMM"

    def describe(self) -> str:
        """e.g. "fp32 GEMM: onednn (A ms; blas B ms at 256x1024x1024; measured now, ...)"."""
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, str(self.dtype))
        if not self.ms:
            return f"{name} {self.role}: {self.backend} ({self.reason})"
        m, k, n = self.shape
        unit, scale = ("us", 1e3) if self.shape == DECODE_SHAPE else ("ms", 1.0)
        others = "".join(f"; {b} {t * scale:.1f} {unit}" for b, t in sorted(self.ms.items()) if b != self.backend)
        when = "" if self.provenance is None else f"; {self.provenance.describe()}"
        return (f"{name} {self.role}: {self.backend} ({self.ms[self.backend] * scale:.1f} {unit}{others} at "
                f"{m}x{k}x{n}{when})")


def _backend_ms(backend: str, dtype: torch.dtype, shape: tuple[int, int, int] = TIMED_SHAPE, calls: int = 1,
                repeats: int = _REPEATS) -> float:
    """The best of `repeats` samples of `calls` calls each, per call, in ms."""
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=generator).to(dtype)
    w = torch.randn(n, k, generator=generator).to(dtype)
    linear_2d(x, w, None, gemm=backend)  # the first call packs and allocates; it is not what a prefill pays
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            linear_2d(x, w, None, gemm=backend)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def choose_gemm_backend(dtype: torch.dtype, ms: Mapping[str, float], shape: tuple[int, int, int] = TIMED_SHAPE,
                        role: str = "GEMM") -> GemmBackendChoice:
    """The policy, apart from the timing: the faster backend (a near-tie goes to PREFERENCE); oneDNN only where it
    can run."""
    timed = {b: t for b, t in ms.items() if b == "blas" or onednn_reason(dtype) is None}
    return GemmBackendChoice(dtype, prefer(timed, PREFERENCE), dict(timed), shape=shape, role=role)


def _decode_record(raw, dtype: torch.dtype, shape: tuple[int, int, int], role: str) -> GemmBackendChoice:
    """A stored backend choice, re-derived from its times; raises ValueError where it names oneDNN and oneDNN
    cannot run this dtype here now."""
    ms = checked_times(raw, GEMM_BACKENDS)
    if "onednn" in ms and onednn_reason(dtype) is not None:
        raise ValueError(f"onednn was measured but cannot run here now: {onednn_reason(dtype)}")
    return choose_gemm_backend(dtype, ms, shape, role)


def _unmeasured(dtype: torch.dtype, role: str) -> Optional[GemmBackendChoice]:
    """The choice where nothing is measured: $TTFTC_CPU_GEMM set, or only BLAS can run this dtype."""
    override = os.environ.get(GEMM_BACKEND_ENV)
    if override is not None:
        if override not in GEMM_BACKENDS:
            raise ValueError(f"{GEMM_BACKEND_ENV}={override!r}: expected one of {', '.join(GEMM_BACKENDS)}, "
                             f"or unset it to measure")
        if override == "onednn" and onednn_reason(dtype) is not None:
            return GemmBackendChoice(dtype, "blas", reason=f"{GEMM_BACKEND_ENV}=onednn, but {onednn_reason(dtype)}",
                                     role=role)
        return GemmBackendChoice(dtype, override, reason=f"set by {GEMM_BACKEND_ENV}", role=role)
    if onednn_reason(dtype) is not None:
        return GemmBackendChoice(dtype, "blas", reason=f"the only backend here: {onednn_reason(dtype)}", role=role)
    return None


def _recorded(name: str, dtype: torch.dtype, shape: tuple[int, int, int], role: str, measure) -> GemmBackendChoice:
    choice, provenance = recall(f"{name}:{str(dtype).removeprefix('torch.')}",
                                lambda: choose_gemm_backend(dtype, measure(), shape, role),
                                lambda chosen: dict(chosen.ms), lambda raw: _decode_record(raw, dtype, shape, role))
    return dataclasses.replace(choice, provenance=provenance)


@functools.cache  # a property of the machine and the build: kept per machine, looked up once per process
def measured_decode_backend(dtype: torch.dtype) -> GemmBackendChoice:
    """The backend the eager batched decode's GEMMs (a few rows each) run with, measured at DECODE_SHAPE."""
    role = "decode GEMM"
    return _unmeasured(dtype, role) or _recorded("decode_gemm", dtype, DECODE_SHAPE, role, lambda: {
        backend: _backend_ms(backend, dtype, DECODE_SHAPE, _DECODE_CALLS, _DECODE_REPEATS)
        for backend in GEMM_BACKENDS})


@functools.cache  # a property of the machine and the build: kept per machine, looked up once per process
def measured_gemm_backend(dtype: torch.dtype) -> GemmBackendChoice:
    """The backend a GEMM of `dtype` runs with when no tuned config names one."""
    return _unmeasured(dtype, "GEMM") or _recorded("gemm_backend", dtype, TIMED_SHAPE, "GEMM", lambda: {
        backend: _backend_ms(backend, dtype) for backend in GEMM_BACKENDS})


def default_gemm(dtype: torch.dtype) -> str:
    return measured_gemm_backend(dtype).backend


def gemm_options(tuning_config: Optional[dict], dtype: torch.dtype) -> dict:
    """The `gemm` and `n_block` arguments of linear_2d: the tuned ones when given, else the defaults for dtype."""
    tuned = tuning_config or {}
    gemm = tuned.get("gemm")
    if gemm not in GEMM_BACKENDS or (gemm == "onednn" and onednn_reason(dtype) is not None):
        gemm = default_gemm(dtype)  # none tuned, or an entry from another build or a damaged file: never an error
    n_block = tuned.get("n_block")
    if isinstance(n_block, bool) or not isinstance(n_block, int) or n_block < 0:
        n_block = DEFAULT_N_BLOCK if gemm == "blas" else 0
    return {"gemm": gemm, "n_block": n_block}


def default_wide_gemm_config(problem) -> dict:
    """Search-space default for the ops whose first tensor is the activation."""
    return gemm_options(None, problem.tensors()[0].dtype)


def wide_gemm_constraint(config: dict, problem) -> Optional[str]:
    if config["gemm"] == "onednn":
        if config["n_block"]:
            return "column blocks apply to the blas backend only"
        return onednn_reason(problem.tensors()[0].dtype)
    return None


def linear_2d(x2d: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], n_block: int = 0, *,
              gemm: str = "blas") -> torch.Tensor:
    """x2d · wᵀ (+ bias) for w stored [N, K] with the chosen backend. With "blas" and n_block > 0, one BLAS call per
    n_block output columns into one buffer (each writes its column slice in place: BLAS takes the row stride as
    ldc, so nothing is copied)."""
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"gemm {gemm!r}: the CPU linear runs one of {GEMM_BACKENDS}")
    if gemm == "onednn":
        # oneDNN honours the strides of x and w but reads a 1-D bias as if it were contiguous.
        bias = bias.contiguous() if bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x2d, w, bias, "none", [], "")
    n = w.shape[0]
    if n_block <= 0 or n <= n_block:
        return torch.addmm(bias, x2d, w.t()) if bias is not None else torch.mm(x2d, w.t())
    out = torch.empty(x2d.shape[0], n, dtype=x2d.dtype, device=x2d.device)
    for start in range(0, n, n_block):
        stop = min(n, start + n_block)
        if bias is not None:
            torch.addmm(bias[start:stop], x2d, w[start:stop].t(), out=out[:, start:stop])
        else:
            torch.mm(x2d, w[start:stop].t(), out=out[:, start:stop])
    return out


def cpu_linear_reason(ctx, x, *weights) -> Optional[str]:
    """Shared capability check: CPU tensors, float dtypes BLAS handles, 2-D weights of x's dtype."""
    if ctx.device_type != "cpu":
        return f"cpu provider, tensors on {ctx.device_type}"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {x.dtype} not supported by the cpu GEMM path"
    for w in weights:
        if w.dim() != 2:
            return f"weight of rank {w.dim()} (want 2)"
        if w.dtype != x.dtype:
            return f"weight dtype {w.dtype} differs from activation dtype {x.dtype}"
    return None
