"""Clocks, device synchronisation and percentiles.

Every time is wall-clock `time.perf_counter()` around a call followed by a device synchronisation, so an
asynchronous device (CUDA, NPU) is charged for its queued work. On CPU the sync is a no-op.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from ttftc.stats import percentile


def synchronize(device: str) -> None:
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize()
    elif kind == "npu" and hasattr(torch, "npu"):
        torch.npu.synchronize()


def time_call(fn: Callable[..., Any], *args: Any, device: str = "cpu") -> float:
    """Seconds one call takes, device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn(*args)
    synchronize(device)
    return time.perf_counter() - start


def summarize_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99, mean and min of samples given in seconds, reported in milliseconds."""
    ms = [s * 1e3 for s in samples_s]
    return {
        "ttft_ms_p50": percentile(ms, 50),
        "ttft_ms_p95": percentile(ms, 95),
        "ttft_ms_p99": percentile(ms, 99),
        "ttft_ms_mean": sum(ms) / len(ms),
        "ttft_ms_min": min(ms),
    }
