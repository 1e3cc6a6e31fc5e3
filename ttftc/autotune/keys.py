"""How a tuning result is named: the hardware it ran on and the problem it solved."""

from __future__ import annotations

import functools
import platform

import torch

from ttftc.autotune.cache import TuneKey
from ttftc.autotune.space import Problem


@functools.lru_cache(maxsize=None)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    """A stable name for the hardware a tuning result is valid on."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name()}"
    return f"{device}:{_cpu_model() or platform.machine()}:{torch.get_num_threads()} threads"


def key_for(problem: Problem, device: str) -> TuneKey:
    return TuneKey(device_name(device), problem.op, problem.provider, problem.signature(), problem.dtype())
