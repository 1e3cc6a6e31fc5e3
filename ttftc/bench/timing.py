"""Clocks, device synchronisation and percentiles.

On CPU (and NPU) a time is wall-clock `time.perf_counter()` around a call followed by a device synchronisation,
so an asynchronous device is charged for its queued work. On CUDA it is the time between two CUDA events
recorded on the current stream before and after the call: the GPU's own clock, at microsecond resolution, with
no host-side synchronisation inside the timed span. The events sit in the stream, so a GPU left idle while the
host prepares launches (Python overhead, a CUDA graph replay's set-up) is still charged to the call: what a
server's first token waits for. `DeviceClock` names which clock a figure came from, and the bench records it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from ttftc.stats import percentile

WALL_CLOCK = "perf_counter + device sync"
CUDA_EVENTS = "CUDA events"


def synchronize(device: str) -> None:
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize()
    elif kind == "npu" and hasattr(torch, "npu"):
        torch.npu.synchronize()


class DeviceClock:
    """Times spans of work on one device: `start()` returns a mark, `stop(mark)` the seconds since it.

    `stop` waits for the device, so each span is complete (and the next starts on an idle device) when it returns.
    """

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.uses_cuda_events = torch.device(device).type == "cuda"
        self.name = CUDA_EVENTS if self.uses_cuda_events else WALL_CLOCK

    def start(self) -> Any:
        synchronize(self.device)
        if self.uses_cuda_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, mark: Any) -> float:
        if self.uses_cuda_events:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return mark.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
        synchronize(self.device)
        return time.perf_counter() - mark


def time_call(fn: Callable[..., Any], *args: Any, device: str = "cpu") -> float:
    """Seconds one call takes, device work included (CUDA events on CUDA, wall clock elsewhere)."""
    clock = DeviceClock(device)
    mark = clock.start()
    fn(*args)
    return clock.stop(mark)


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
