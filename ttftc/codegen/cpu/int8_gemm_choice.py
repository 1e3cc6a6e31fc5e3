"""Which GEMM runs the W8A8 linears on this CPU: every candidate checked for exactness, then timed, here.

No CPU class is fast at int8 in general:
- ATen's CPU `torch._int_mm` calls oneDNN only where the CPU has VNNI; elsewhere it runs a plain dot-product loop
  (aten LinearAlgebra.cpp, `_int_mm_out_cpu`), far slower than an fp32 GEMM (benchmarks/README.md, int8).
- oneDNN's quantised linear with a u8 activation is fast everywhere, but without VNNI it multiplies with AVX2's
  `vpmaddubsw`, whose 16-bit pair sums saturate on full-range operands: wrong numbers (pytorch issue 136746).
So each candidate is first run on full-range operands, including the extreme rows that saturate a 16-bit pair
sum, and compared with the exact int32 product; one that differs is refused with its reason. The exact candidates
are then timed at one llama-sized shape, and the fastest wins, provided it beats one fp32 GEMM over the same
integer-valued operands (the "fp32" candidate: the W8A8 numbers up to fp32 rounding, at fp32 speed), which is what
runs where no int8 GEMM is faster. Nothing here knows a CPU by name: the same code picks oneDNN's u8 GEMM on one
machine and `_int_mm` or fp32 on another.

Candidates are functions `gemm(xq, x_scale, w_int8, w_scale, bias, out_dtype) -> out` (ttftc/codegen/cpu/
int8_linear.py owns them); this module only checks, times and chooses, so the policy is testable with any timings.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional

import torch

from ttftc.codegen.cpu.measured import Provenance, checked_times, prefer

Gemm = Callable[..., torch.Tensor]
FP32 = "fp32"
# The near-tie order among exact int8 GEMMs (measured.prefer): ATen's own GEMM first, then oneDNN's, then ttftc's:
# at the same speed, the GEMM with no packed copy of the weights to hold wins.
PREFERENCE = ("int_mm", "onednn_u8", "native_avx2")
# The timed shape: a 256-token prompt through a 1024-wide projection (llama-135m's hidden size). Big enough that
# the GEMM, not the call overhead, is what is timed; small enough that the slowest candidate costs well under 1 s.
TIMED_SHAPE = (256, 1024, 1024)
_REPEATS = 3
# A candidate whose first call takes this many times the fp32 GEMM's is not repeated: it cannot win.
_HOPELESS = 8.0


@dataclass(frozen=True)
class Int8GemmChoice:
    gemm: str  # the candidate that runs by default: an int8 GEMM, or FP32 where none beats fp32
    shape: tuple[int, int, int]  # (M, K, N) timed
    ms: Mapping[str, float] = field(default_factory=dict)  # measured candidates, FP32 included
    refused: Mapping[str, str] = field(default_factory=dict)  # candidate -> why it was not timed
    provenance: Optional[Provenance] = field(default=None, compare=False)  # measured now or loaded, and when
    forced_by: str = ""  # the override that set it, where one did (nothing was timed then)

    @property
    def int8_speedup(self) -> float:
        """fp32 GEMM time / the fastest exact int8 GEMM's time (nan where none was timed)."""
        int8 = [ms for name, ms in self.ms.items() if name != FP32]
        return self.ms.get(FP32, math.nan) / min(int8) if int8 else math.nan

    def usable(self, name: str) -> bool:
        """Whether candidate `name` may run here: exact, and not measured slower than fp32 (a tuned knob or a
        stored graph may name one that another machine preferred)."""
        if name in self.refused:
            return False
        ms, fp32 = self.ms.get(name), self.ms.get(FP32)
        return ms is None or fp32 is None or ms < fp32 or name == FP32

    def without(self, unavailable: Mapping[str, str]) -> "Int8GemmChoice":
        """The choice among the same measurements once `unavailable` (candidate -> why) cannot run: a provider the
        measurement saw may be gone later in the process (its extension switched off), and a choice that names it
        must fall to the next measured candidate, never be called."""
        gone = {name: why for name, why in unavailable.items() if name != FP32 and name not in self.refused}
        if not gone:
            return self
        refused = {**self.refused, **gone}
        fallen = choose({name: ms for name, ms in self.ms.items() if name not in refused}, refused, self.shape)
        return replace(fallen, provenance=self.provenance)

    def describe(self) -> str:
        """e.g. "int8 GEMM: onednn_u8 (A ms; int_mm B ms, fp32 C ms at 256x1024x1024; measured now, ...)", with the
        machine's times and whether this process measured them or loaded them."""
        m, k, n = self.shape
        others = [f"{name} {ms:.1f} ms" for name, ms in sorted(self.ms.items()) if name != self.gemm]
        others += [f"{name} refused: {why}" for name, why in sorted(self.refused.items())]
        chosen = self.ms.get(self.gemm)
        mine = "" if chosen is None else f"{chosen:.1f} ms"
        when = "" if self.provenance is None else f"; {self.provenance.describe()}"
        if self.forced_by:
            return f"int8 GEMM: {self.gemm} (set by {self.forced_by}; checked exact here, not timed)"
        return f"int8 GEMM: {self.gemm} ({'; '.join([mine] + others if mine else others)} at {m}x{k}x{n}{when})"


def choose(ms: Mapping[str, float], refused: Mapping[str, str], shape: tuple[int, int, int]) -> Int8GemmChoice:
    """The policy: the fastest timed int8 candidate (a near-tie goes to PREFERENCE) if it beats FP32 by more than
    a near-tie, else FP32 (which `measure` always times): an int8 GEMM that only ties fp32 loses, the quantisation
    around it would make it a loss."""
    int8 = {name: t for name, t in ms.items() if name != FP32 and name not in refused}
    best = prefer(int8, PREFERENCE) if int8 else None
    fp32 = ms.get(FP32, math.inf)
    gemm = best if best is not None and prefer({FP32: fp32, best: int8[best]}, (FP32,)) == best else FP32
    return Int8GemmChoice(gemm, shape, dict(ms), dict(refused))


def full_range_operands(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """xq [m, k] over all of int8 and w [n, k] over [-127, 127] (the range ttftc's quantiser gives weights), with
    rows of +127, -127 and -128 next to weights of both signs: the largest products any operands can make, which a
    saturating 16-bit pair sum gets wrong. Activations reach -128 although the quantiser stops at -127: a GEMM that
    moves signs around (|x| as u8) must be right on the one int8 whose negation does not fit."""
    generator = torch.Generator().manual_seed(seed)
    xq = torch.randint(-128, 128, (m, k), generator=generator, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    xq[0], xq[1], xq[2] = 127, -127, -128
    w[0], w[1] = 127, -127
    w[2, 0::2], w[2, 1::2] = 127, -127
    return xq, w


def exactness_reason(gemm: Gemm, *, shape: tuple[int, int, int] = (64, 256, 64)) -> Optional[str]:
    """None when `gemm` reproduces the exact int32 product of full-range operands, else how it differs.

    Unit scales make its output the integer product itself; K=256 keeps every sum (at most 256 · 128 · 127) below
    2**24, where fp32 holds integers exactly, so any difference is the GEMM's, not the output format's."""
    m, k, n = shape
    xq, w = full_range_operands(m, k, n)
    exact = (xq.to(torch.int64) @ w.to(torch.int64).t()).to(torch.float32)
    # Both layouts a frozen weight comes in: row-major [N, K], and a transposed view (GPT-2's Conv1D).
    for layout, weight in (("", w), (" with a transposed-view weight", w.t().contiguous().t())):
        try:
            out = gemm(xq, torch.ones(m), weight, torch.ones(n), None, torch.float32).float()
        except Exception as exc:  # a candidate this build cannot run is refused, not fatal
            return f"{type(exc).__name__}: {exc}"
        wrong = int((out != exact).sum())
        if wrong:
            return (f"differs from the exact int32 product on {wrong} of {out.numel()} elements of full-range "
                    f"operands{layout} (max difference {float((out - exact).abs().max()):.0f})")
    return None


def time_ms(gemm: Gemm, shape: tuple[int, int, int], *, give_up_after_ms: float = math.inf) -> float:
    """The fastest of a few calls of `gemm` at `shape`, in milliseconds: the minimum, because another process on
    the machine only ever adds time (the first call warms up and is not counted, unless it already took
    `give_up_after_ms`: then that call is the measurement)."""
    m, k, n = shape
    xq, w = full_range_operands(m, k, n, seed=1)
    args = (xq, torch.rand(m) / 127, w, torch.rand(n) / 127, None, torch.float32)
    start = time.perf_counter()
    gemm(*args)
    first = (time.perf_counter() - start) * 1e3
    if first >= give_up_after_ms:
        return first
    samples = []
    for _ in range(_REPEATS):
        start = time.perf_counter()
        gemm(*args)
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def measure(candidates: Mapping[str, Gemm], unavailable: Mapping[str, str],
            shape: tuple[int, int, int] = TIMED_SHAPE) -> Int8GemmChoice:
    """Check every available candidate for exactness, time the exact ones (FP32 first, which must be present), and
    choose. `unavailable` maps candidates this build lacks to the reason."""
    refused = dict(unavailable)
    for name, gemm in candidates.items():
        if name not in refused:
            reason = exactness_reason(gemm)
            if reason is not None:
                refused[name] = reason
    if FP32 in refused:
        raise RuntimeError(f"the fp32 fallback GEMM is not exact on this machine: {refused[FP32]}")
    ms = {FP32: time_ms(candidates[FP32], shape)}
    for name, gemm in candidates.items():
        if name not in refused and name != FP32:
            ms[name] = time_ms(gemm, shape, give_up_after_ms=_HOPELESS * ms[FP32])
    return choose(ms, refused, shape)


def encode(choice: Int8GemmChoice) -> dict:
    """The JSON a machine's record keeps: the measurements, from which `decode` re-derives the choice."""
    return {"shape": list(choice.shape), "ms": dict(choice.ms), "refused": dict(choice.refused)}


def decode(raw, candidates: Mapping[str, Gemm], unavailable: Mapping[str, str]) -> Int8GemmChoice:
    """A stored choice, re-derived by `choose` from its measurements; raises ValueError where the record is not
    one, names a candidate that cannot run here now, or where a candidate it did not refuse is not exact here
    (a forged record must not make an inexact GEMM run: the check costs two small GEMMs per candidate)."""
    if not isinstance(raw, dict):
        raise ValueError("an int8 GEMM record must be a JSON object")
    shape = raw.get("shape")
    if (not isinstance(shape, list) or len(shape) != 3
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= 1 << 20 for d in shape)):
        raise ValueError(f"shape {str(shape)[:80]} is not three positive ints")
    ms = checked_times(raw.get("ms"), tuple(candidates))
    refused = raw.get("refused")
    if not isinstance(refused, dict) or not all(name in candidates and isinstance(why, str)
                                                for name, why in refused.items()):
        raise ValueError("refused must map candidates to reasons")
    if FP32 not in ms or FP32 in refused or set(ms) & set(refused):
        raise ValueError("fp32 must be timed, and no candidate both timed and refused")
    for name in ms:
        if name in unavailable:
            raise ValueError(f"{name} was measured but cannot run here now: {unavailable[name]}")
    for name in ms:
        reason = exactness_reason(candidates[name])
        if reason is not None:
            raise ValueError(f"{name} is not exact here: {reason}")
    return choose(ms, {**refused, **{n: why for n, why in unavailable.items() if n not in ms}}, tuple(shape))
