"""The roofline bound of a prefill: its FLOPs divided by the device's GEMM peak, measured in the same run.

FLOPs (2 per multiply-add) of one prefill of T tokens, batch 1:
    linear layers   2 · T · Σ in·out over every linear layer except the output embedding (lm_head)
    attention       per layer: 2 · 2 · n_heads · head_dim · P(T), for QKᵀ and for P·V, where
                    P(T) = Σ_{i=1..T} min(i, window) is the number of causal (query, key) pairs; with no sliding
                    window P(T) = T(T+1)/2
    lm_head         2 · in · out, for the last token only (the prefill keeps one position of logits)
Norms, activations, rotary embeddings and softmax are not counted: they are not GEMM work, and the bound is
a lower bound on time anyway. Linear shapes are read from the modules (nn.Linear and Hugging Face's GPT-2
Conv1D), so merged projections (Phi-3's qkv_proj) and biases' absence need no special cases; a mixture of
experts would be over-counted (every expert counted), which no preset has.

The peak is the best of square GEMMs per dtype over every GEMM primitive the device offers: fp32 and bf16 `torch.mm`
and, on CPU, oneDNN's matmul (which ttftc's CPU lowerings use; it can beat MKL's fp32 sgemm, so a peak from
`torch.mm` alone would understate the machine and overstate every efficiency); int8: on CPU the int8 GEMM that
ttftc measured and chose for this machine (codegen/cpu/int8_gemm_choice.py: where no int8 GEMM beats fp32 that
is the fp32 GEMM, and the int8 "peak" says so), elsewhere `torch._int_mm` (int8 x int8 → int32). Timed at the start
of the run and once more in every measured round (PeakMeter), except a GEMM whose first call took over
SLOW_GEMM_S (an emulated bf16 GEMM, a plain int8 loop): its first time stands, so a slow primitive cannot eat the
run. The best, not the median, because other work on a shared machine can only slow a GEMM down. A variant is bounded by the peak of the dtype its GEMMs run in (fp32, bf16 or int8) for all of its
FLOPs, attention included; so an int8 variant's bound is optimistic where its attention stays in floating point.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ttftc.codegen.cpu.int8_linear import GEMMS as INT8_GEMMS
from ttftc.codegen.cpu.int8_linear import int8_gemm_choice

from ttftc.bench.timing import time_call

PEAK_DTYPES = ("fp32", "bf16", "int8")
SLOW_GEMM_S = 1.0


@dataclass(frozen=True)
class PrefillShape:
    """What the FLOP formula needs from a model."""

    linear_shapes: tuple[tuple[int, int], ...]  # (in, out) of every linear layer except the lm_head
    lm_head: tuple[int, int]  # (in, out)
    num_layers: int
    num_heads: int
    head_dim: int
    # Per layer: the sliding window in tokens, or None for full causal attention.
    windows: tuple[Optional[int], ...]


def _linear_in_out(module: torch.nn.Module) -> Optional[tuple[int, int]]:
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "weight") and module.weight.dim() == 2:
        in_features, out_features = module.weight.shape  # HF GPT-2 Conv1D: y = x @ W, W is (in, out)
        return int(in_features), int(out_features)
    return None


def _layer_windows(config, num_layers: int) -> tuple[Optional[int], ...]:
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or not getattr(config, "use_sliding_window", True):
        return (None,) * num_layers
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == num_layers:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (window,) * num_layers


def describe_prefill(model: torch.nn.Module) -> PrefillShape:
    config = model.config
    head = model.get_output_embeddings()
    head_shape = _linear_in_out(head) if head is not None else None
    if head_shape is None:
        raise ValueError(f"{type(model).__name__} has no linear output embedding (lm_head) to count")
    linear = tuple(
        shape for module in model.modules() if module is not head and (shape := _linear_in_out(module)) is not None
    )
    num_layers = int(config.num_hidden_layers)
    num_heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return PrefillShape(linear, head_shape, num_layers, num_heads, int(head_dim), _layer_windows(config, num_layers))


def causal_pairs(seq: int, window: Optional[int] = None) -> int:
    """How many (query, key) pairs causal attention over `seq` tokens computes: Σ_{i=1..seq} min(i, window)."""
    if window is None or window >= seq:
        return seq * (seq + 1) // 2
    return window * (window + 1) // 2 + (seq - window) * window


def prefill_flops(shape: PrefillShape, seq: int) -> int:
    linear = 2 * seq * sum(i * o for i, o in shape.linear_shapes)
    attention = sum(4 * shape.num_heads * shape.head_dim * causal_pairs(seq, w) for w in shape.windows)
    lm_head = 2 * shape.lm_head[0] * shape.lm_head[1]
    return linear + attention + lm_head


@dataclass(frozen=True)
class GemmPeak:
    dtype: str
    gflops: Optional[float]  # GFLOP/s (GOP/s for int8); None when it could not be measured
    op: str
    size: int  # the GEMM is size x size x size
    error: Optional[str] = None
    samples: int = 0  # how many timed GEMMs the best was taken from


_OPERAND_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


class PeakMeter:
    """The best GEMM throughput per dtype seen so far in this run.

    `sample()` times one more GEMM per dtype. The bench samples at the start and again in every measured round,
    so the peak is taken over the same stretch of time as the TTFTs: a peak measured only while the machine was
    busy would inflate the bound (and push efficiencies above 1) once the load goes away.
    """

    def __init__(self, *, device: str = "cpu", size: int = 2048, dtypes: tuple[str, ...] = PEAK_DTYPES):
        self.device = device
        self.size = size
        self._gemms: dict[str, list[tuple[str, Callable, torch.Tensor, torch.Tensor]]] = {}
        self._best: dict[str, tuple[float, str]] = {}
        self._samples: dict[str, int] = {d: 0 for d in dtypes}
        self._errors: dict[str, str] = {}
        self._slow: dict[tuple[str, str], float] = {}  # (dtype, name) -> seconds of the one call that is timed
        for dtype in dtypes:
            for name, fn, a, b in self._candidates(dtype):
                try:
                    first = self._time(fn, a, b)  # warm-up: library initialisation and first-touch page faults
                except Exception as exc:  # e.g. no int8 GEMM on this device
                    self._errors.setdefault(dtype, f"{name}: {type(exc).__name__}: {exc}".splitlines()[0])
                    continue
                if first > SLOW_GEMM_S:
                    self._slow[dtype, name] = first
                self._gemms.setdefault(dtype, []).append((name, fn, a, b))
            if dtype in self._gemms:
                self._errors.pop(dtype, None)

    def _candidates(self, dtype: str) -> list[tuple[str, Callable, torch.Tensor, torch.Tensor]]:
        n, device = self.size, self.device
        if dtype == "int8":
            a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
            b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
            if torch.device(device).type != "cpu":
                return [("torch._int_mm", torch._int_mm, a, b)]
            choice = int8_gemm_choice()
            return [(f"ttftc int8 GEMM: {choice.gemm}", _chosen_int8_mm(INT8_GEMMS[choice.gemm]), a, b)]
        a = torch.randn(n, n, device=device).to(_OPERAND_DTYPES[dtype])
        b = torch.randn(n, n, device=device).to(_OPERAND_DTYPES[dtype])
        candidates = [("torch.mm", torch.mm, a, b)]
        if torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available():
            candidates.append(("oneDNN matmul", _onednn_mm, a, b))
        return candidates

    def _time(self, fn, a, b) -> float:
        return time_call(fn, a, b, device=self.device)

    def sample(self, repeats: int = 1) -> None:
        resolution = time.get_clock_info("perf_counter").resolution
        for dtype, gemms in self._gemms.items():
            for _ in range(repeats):
                for name, fn, a, b in gemms:
                    seconds = self._slow.get((dtype, name))
                    if seconds is None:
                        seconds = self._time(fn, a, b)
                    gflops = 2.0 * self.size**3 / max(seconds, resolution) / 1e9
                    if gflops > self._best.get(dtype, (0.0, ""))[0]:
                        self._best[dtype] = (gflops, name)
                self._samples[dtype] += 1

    def peaks(self) -> dict[str, GemmPeak]:
        peaks = {}
        for d in self._samples:
            gflops, name = self._best.get(d, (None, ", ".join(g[0] for g in self._gemms.get(d, [])) or "none"))
            peaks[d] = GemmPeak(d, gflops, name, self.size, self._errors.get(d), self._samples[d])
        return peaks


def _chosen_int8_mm(gemm: Callable) -> Callable:
    """a · bᵀ (both int8, square) through one of ttftc's CPU int8 GEMMs, with unit scales."""
    return lambda a, b: gemm(a, torch.ones(a.shape[0]), b, torch.ones(b.shape[0]), None, torch.float32)


def _onednn_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a · bᵀ through oneDNN: the same FLOPs as torch.mm(a, b) on square operands."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def measure_gemm_peak(dtype: str, *, device: str = "cpu", size: int = 2048, repeats: int = 4) -> GemmPeak:
    meter = PeakMeter(device=device, size=size, dtypes=(dtype,))
    meter.sample(max(1, repeats))
    return meter.peaks()[dtype]


def measure_peaks(*, device: str = "cpu", size: int = 2048, repeats: int = 4) -> dict[str, GemmPeak]:
    meter = PeakMeter(device=device, size=size)
    meter.sample(max(1, repeats))
    return meter.peaks()


def bound_ms(flops: int, peak: Optional[GemmPeak]) -> Optional[float]:
    if peak is None or not peak.gflops:
        return None
    return flops / (peak.gflops * 1e9) * 1e3
