"""Timers for the tuner. A timer is any callable (fn, config) -> milliseconds.

WallTimer measures for real: warm-up calls, then the median of several timed calls (device-synchronised on
CUDA). Tests pass a deterministic stand-in that still calls `fn` (so the kernel really runs) but scores by config.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass(frozen=True)
class WallTimer:
    device: str = "cpu"
    warmup: int = 2
    repeats: int = 5

    def __call__(self, fn: Callable[[], Any], config: dict) -> float:
        for _ in range(self.warmup):
            fn()
        _sync(self.device)
        samples = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            fn()
            _sync(self.device)
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
