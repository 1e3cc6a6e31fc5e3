"""What the machine can do fast, probed once per process: native bf16, int8 dot products (VNNI), AMX.

The precision policy (`precision="auto"`) and the CPU lowerings decide from this, never from where ttftc was
developed: on a CPU without bf16 instructions oneDNN still runs bf16 GEMMs, emulated, at a fraction of fp32 speed,
while on one with them bf16 runs faster than fp32 (benchmarks/README.md, bf16, has the figures and their CPUs).

Native bf16 is decided by measurement: a small GEMM is timed in both dtypes, and bf16 counts as native only when it
is faster by NATIVE_SPEEDUP. The timings are kept per machine (codegen/cpu/measured.py), so that every process on a
machine decides the same: native bf16 and bf16 attention join the precision pass's uuid, and through it the
compile-cache key. The flags only skip the timing where they settle the answer negatively (no bf16
instruction listed and no oneDNN bf16 path); listed bf16 instructions are not enough on their own, since a torch
build or a hypervisor can leave them unused. $TTFTC_NATIVE_BF16 (0 or 1) overrides the answer.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ttftc.codegen.cpu import _native
from ttftc.codegen.cpu import attention as cpu_attention
from ttftc.codegen.cpu.measured import Provenance, checked_times, cpu_flags_and_name, recall

# Overrides the probe's answer ("0" or "1"): for a machine the probe gets wrong, and for tests that must not
# depend on the CPU they run on.
NATIVE_BF16_ENV = "TTFTC_NATIVE_BF16"
# A bf16 GEMM must beat fp32 by this much in the timing probe to count as native (emulated bf16 is several times
# slower than fp32: benchmarks/README.md, bf16).
NATIVE_SPEEDUP = 1.2
# Attention runs in bf16 only when its kernel beats fp32 by this much: the casts around it cost a pass over q, k, v
# and the output, and a kernel with fp32 inner products gains little from bf16 (benchmarks/README.md, bf16).
ATTENTION_SPEEDUP = 1.1
_PROBE_SIZE = 512


@dataclass(frozen=True)
class Capabilities:
    device: str  # "cpu" | "cuda" | "npu"
    name: str  # CPU model or accelerator name
    native_bf16: bool
    bf16_evidence: str  # why native_bf16 is what it is, for explain
    int8_dot: bool  # VNNI-class int8 dot-product instructions (x86 avx512_vnni/avx_vnni/amx_int8, Arm i8mm/dotprod)
    amx: bool
    flags: tuple[str, ...] = ()  # the flags among those ttftc looks at
    # fp32 time / bf16 time of the attention kernel, measured where bf16 is native; None where not measured.
    bf16_attention_speedup: Optional[float] = None
    # The instruction set ttftc's native CPU kernels run with here, or why they do not run (CPU only).
    native_kernels: Optional[str] = None

    @property
    def bf16_attention(self) -> bool:
        """Whether attention is worth running in bf16: native bf16, and (where measured) a faster kernel."""
        speedup = self.bf16_attention_speedup
        return self.native_bf16 and (speedup is None or speedup >= ATTENTION_SPEEDUP)

    def describe(self) -> str:
        flags = ",".join(self.flags) or "none of avx512_bf16/amx/vnni"
        attention = ("" if self.bf16_attention_speedup is None
                     else f"; bf16 attention {self.bf16_attention_speedup:.2f}x fp32 (measured)")
        native = "" if self.native_kernels is None else f"; ttftc native kernels: {self.native_kernels}"
        return (f"{self.device} {self.name}: native bf16 {'yes' if self.native_bf16 else 'no'} ({self.bf16_evidence})"
                f"{attention}; int8 dot {'yes' if self.int8_dot else 'no'}; AMX {'yes' if self.amx else 'no'}; "
                f"flags {flags}{native}")


_WATCHED_FLAGS = ("avx512_bf16", "amx_bf16", "amx_int8", "amx_tile", "avx512_vnni", "avx_vnni", "avx512f",
                  "bf16", "i8mm", "asimddp")


_cpu_flags_and_name = cpu_flags_and_name  # the probe reads the flags through this name: tests mock a CPU with it


def _gemm_seconds(dtype: torch.dtype, repeats: int = 5) -> float:
    a = torch.randn(_PROBE_SIZE, _PROBE_SIZE).to(dtype)
    b = torch.randn(_PROBE_SIZE, _PROBE_SIZE).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def bf16_gemm_measurement() -> tuple[dict[str, float], Provenance]:
    """Seconds of a 512^3 GEMM in fp32 and in bf16 on this machine (kept per machine), and where they came from."""
    return recall("bf16_gemm", lambda: {"fp32": _gemm_seconds(torch.float32), "bf16": _gemm_seconds(torch.bfloat16)},
                  dict, _stored_gemm_seconds)


def _stored_gemm_seconds(raw) -> dict[str, float]:
    times = checked_times(raw, ("fp32", "bf16"))
    if set(times) != {"fp32", "bf16"}:
        raise ValueError("both dtypes must be timed")
    return times


def measured_bf16_speedup() -> float:
    """fp32 GEMM time / bf16 GEMM time at 512^3 on this CPU (above 1: bf16 is faster), measured once per machine."""
    seconds = bf16_gemm_measurement()[0]
    return seconds["fp32"] / seconds["bf16"]


@functools.cache
def measured_bf16_attention_speedup() -> float:
    """fp32 time / bf16 time of causal prefill attention (8 heads x 512 tokens x 64) on this CPU, each dtype on its
    fastest CPU kernel (ttftc's native fp32 kernel, ATen's flash kernel, or the GEMM-blocked one), measured once."""
    seconds = cpu_attention.kernel_seconds  # the kernels the CPU lowering will run
    return min(seconds(torch.float32).values()) / min(seconds(torch.bfloat16).values())


def _cpu() -> Capabilities:
    flags, name = _cpu_flags_and_name()
    watched = tuple(f for f in _WATCHED_FLAGS if flags and f in flags)
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    override = os.environ.get(NATIVE_BF16_ENV)
    if override in ("0", "1"):
        native, evidence = override == "1", f"set by {NATIVE_BF16_ENV}={override}"
    elif flags is not None and not ({"avx512_bf16", "amx_bf16", "bf16"} & flags) and not onednn_bf16:
        native, evidence = False, "no bf16 instructions in the CPU flags, and oneDNN has no bf16 path"
    else:
        speedup = measured_bf16_speedup()
        native = speedup >= NATIVE_SPEEDUP
        listed = flags is not None and bool({"avx512_bf16", "amx_bf16", "bf16"} & flags)
        evidence = (f"{'bf16 instructions in the CPU flags' if listed else 'flags inconclusive'}; measured bf16 GEMM "
                    f"{speedup:.2f}x fp32 at {_PROBE_SIZE}^3 (native needs >= {NATIVE_SPEEDUP}x; "
                    f"{bf16_gemm_measurement()[1].describe()})")
    int8_dot = bool(flags and {"avx512_vnni", "avx_vnni", "amx_int8", "i8mm", "asimddp"} & flags)
    amx = bool(flags and {"amx_tile", "amx_bf16", "amx_int8"} & flags)
    attention = measured_bf16_attention_speedup() if native and override is None else None
    kernels = _native.isa() or _native.unavailable_reason()
    return Capabilities("cpu", name, native, evidence, int8_dot, amx, watched, attention, kernels)


def _cuda() -> Capabilities:
    name = torch.cuda.get_device_name()
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    major, _ = torch.cuda.get_device_capability()
    return Capabilities("cuda", name, native, "torch.cuda.is_bf16_supported", major >= 7, False)


@functools.cache
def probe(device: str = "cpu") -> Capabilities:
    """The capabilities of `device` ("cpu", "cuda", "npu"), probed once per process."""
    if device == "cuda" and torch.cuda.is_available():
        return _cuda()
    if device == "npu":
        # Ascend 910B-class NPUs compute bf16 natively; torch_npu has no finer probe.
        return Capabilities("npu", "Ascend", True, "Ascend NPUs compute bf16 natively", True, False)
    return _cpu()
