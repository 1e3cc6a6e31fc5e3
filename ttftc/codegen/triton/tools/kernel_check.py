"""Compile every kernel case for each target and judge the result against the target's real limits.

A case fails when the compiler rejects it, when it needs more shared memory (GPUs) or Unified Buffer (Ascend, the
IR estimate of ascend_lowering) than one program of the target may have, or when it is a default config that
spills registers to memory (NVIDIA spill stores; AMD spilled VGPRs or scratch). AMD scalar registers spilled into
vector-register lanes touch no memory and are reported, not failed. Every case here is a config the tuner or the
untuned lowering could pick, so any failure is a real defect.
"""

from __future__ import annotations

import functools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from ttftc.codegen.triton.targets import Target
from ttftc.codegen.triton.tools import compile_worker
from ttftc.codegen.triton.tools.ascend_lowering import ensure_venv, lower_in_venv
from ttftc.codegen.triton.tools.catalog import KernelCase, kernel_cases

if TYPE_CHECKING:
    from ttftc.codegen.triton.tools.aot import CompileResult


@dataclass(frozen=True)
class CheckedCase:
    case: dict  # KernelCase.describe()
    kernel: str
    target: str
    ok: bool  # compiled (or lowered)
    error: str = ""
    shared_bytes: Optional[int] = None  # GPUs: per program
    registers: Optional[int] = None
    spill_bytes: Optional[int] = None
    sgpr_spills: Optional[int] = None
    ub_bytes: Optional[int] = None  # Ascend: the footprint estimate
    failures: tuple[str, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        return not self.failures


def judge(case: dict, target: Target, *, ok: bool, error: str = "", shared_bytes: Optional[int] = None,
          spill_bytes: Optional[int] = None, ub_bytes: Optional[int] = None) -> tuple[str, ...]:
    """Why this compiled case is unusable on `target` (empty when it is fine)."""
    if not ok:
        return (f"compiler error: {error}",)
    failures = []
    if target.is_gpu and shared_bytes is not None and shared_bytes > target.shared_memory_per_block:
        failures.append(f"needs {shared_bytes} B of shared memory, {target.device} allows "
                        f"{target.shared_memory_per_block} B per block")
    if target.backend == "npu" and ub_bytes is not None and ub_bytes > target.unified_buffer_bytes:
        failures.append(f"Unified Buffer estimate {ub_bytes} B exceeds {target.unified_buffer_bytes} B")
    if case["default"] and spill_bytes:
        failures.append(f"default config spills {spill_bytes} B per thread")
    return tuple(failures)


def _checked(case: KernelCase, target: Target, result: CompileResult) -> CheckedCase:
    r = result.resources
    described = case.describe()
    shared = r.shared_bytes if r else None
    spills = r.spill_bytes if r else None
    failures = judge(described, target, ok=result.ok, error=result.error, shared_bytes=shared, spill_bytes=spills)
    return CheckedCase(described, result.kernel, target.name, result.ok, result.error, shared,
                       r.registers if r else None, spills, r.sgpr_spills if r else None, failures=failures)


@functools.lru_cache(maxsize=8)
def _cases(target: Target, ops: Optional[tuple[str, ...]], defaults_only: bool) -> list[KernelCase]:
    return kernel_cases(target, ops=ops, defaults_only=defaults_only)


def _check_one(target: Target, ops: Optional[tuple[str, ...]], defaults_only: bool, index: int) -> CheckedCase:
    # Cases hold closures, which do not pickle: a worker rebuilds the (deterministic) list and takes its index.
    from ttftc.codegen.triton.tools.aot import compile_launch  # lazy: triton, absent where only Ascend is lowered

    case = _cases(target, ops, defaults_only)[index]
    return _checked(case, target, compile_launch(case.build(), target))


def check_gpu(target: Target, *, ops: Optional[tuple[str, ...]] = None, defaults_only: bool = False,
              jobs: int = 1, progress: Optional[Callable[[CheckedCase], None]] = None) -> list[CheckedCase]:
    """Compile every case for a GPU target in `jobs` worker processes (started fresh: see compile_worker.py)."""
    count = len(_cases(target, ops, defaults_only))
    results = []
    with ProcessPoolExecutor(max(1, jobs), mp_context=multiprocessing.get_context("spawn"),
                             initializer=compile_worker.start) as pool:
        futures = [pool.submit(_check_one, target, ops, defaults_only, i) for i in range(count)]
        for future in futures:
            results.append(future.result())
            if progress:
                progress(results[-1])
    return results


def check_ascend(target: Target, *, ops: Optional[tuple[str, ...]] = None, defaults_only: bool = False,
                 build_venv: bool = False) -> list[CheckedCase]:
    """Lower every case for an Ascend target in triton-ascend's venv (built first when `build_venv`)."""
    python = ensure_venv(build=build_venv)
    checked = []
    for r in lower_in_venv(target.name, ops=ops, defaults_only=defaults_only, python=python):
        failures = judge(r.case, target, ok=r.ok, error=r.error, ub_bytes=r.ub_bytes if r.ok else None)
        checked.append(CheckedCase(r.case, r.kernel, target.name, r.ok, r.error,
                                   ub_bytes=r.ub_bytes if r.ok else None, failures=failures))
    return checked
