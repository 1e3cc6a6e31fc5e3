"""The intra-op thread count as an autotune knob of the CPU lowerings.

A CPU lowering decorated with `honours_num_threads` accepts `tuning_config={"num_threads": n, ...}` and runs under
`n` ATen/OpenMP threads, restoring the previous count afterwards. The count is only switched when it differs from
`torch.get_num_threads()`, so the default (the current count) costs nothing. Small GEMMs and attention over few
heads can run faster on fewer threads than the machine has (less fork/join and barrier time); the tuner measures it.

`with_thread_axis(space)` adds the `num_threads` axis to a SearchSpace: None ("whatever count the process runs
with", the default), then powers of two below the number of cores this process may run on and that number itself
(a 12-core box tries 1, 2, 4, 8, 12), so the grid grows by a logarithmic factor only. A config that keeps the
default stores None, not the count of the tuning process, so a compiled graph or AOT artifact built from it follows
the thread count of the process that runs it; only a count that measurably won is stored as a number. The autotune
cache key's device name carries the thread count at tuning time (autotune/keys.py).

A stored count is clamped to [1, usable_cores()]: a config read from a cache or an artifact cannot start more threads
than the process may run on.

Whether switching the count is per thread depends on torch's parallel backend. With OpenMP (the backend of the
Linux CPU wheels, this project's supported builds), `torch.set_num_threads` sets the calling thread's OpenMP ICV and
MKL's thread-local count: another thread that has already run parallel ATen work keeps its own count. That was
measured on torch 2.13.0+cpu (tests/security/test_small_items.py checks it): a thread switched to 1 thread left a
matmul running in another thread at that thread's own speed (benchmarks/README.md, threads). So
on OpenMP builds switched regions run concurrently; on other backends, whose pool every thread shares, they hold a
lock so that two threads cannot interleave their save and restore. One caveat on OpenMP remains: torch also records
the last count set as the default of threads that have not yet run parallel work, so a thread whose first parallel
op starts while another thread is switched begins at the switched count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import threading
from typing import Callable, Iterator, Optional

import torch

from ttftc.autotune.space import Problem, SearchSpace

KNOB = "num_threads"
_SWITCH_LOCK = threading.Lock()  # only where the count is shared by every thread (see the module docstring)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), which can be fewer than the machine has."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def thread_counts(cores: Optional[int] = None) -> tuple[int, ...]:
    """Powers of two below `cores`, then `cores` itself: (1, 2, 4, 8, 12) for 12."""
    cores = usable_cores() if cores is None else max(1, int(cores))
    counts = []
    n = 1
    while n < cores:
        counts.append(n)
        n *= 2
    counts.append(cores)
    return tuple(counts)


@functools.lru_cache(maxsize=1)
def count_is_per_thread() -> bool:
    """Whether `torch.set_num_threads` changes only the calling thread's count (OpenMP builds)."""
    return "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def intra_op_threads(n: Optional[int]) -> Iterator[None]:
    """Run the body under `n` intra-op threads (None or the current count: no change), then restore."""
    if n is None or int(n) == torch.get_num_threads():
        yield
        return
    with contextlib.nullcontext() if count_is_per_thread() else _SWITCH_LOCK:
        previous = torch.get_num_threads()
        torch.set_num_threads(int(n))
        try:
            yield
        finally:
            torch.set_num_threads(previous)


def threads_of(tuning_config: Optional[dict]) -> Optional[int]:
    """The config's thread count, clamped to the cores this process may use (None: keep the current count)."""
    value = (tuning_config or {}).get(KNOB)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"tuning_config[{KNOB!r}] must be an int or None, got {value!r}")
    return max(1, min(value, usable_cores()))


def honours_num_threads(impl: Callable) -> Callable:
    """Wrap a CPU lowering so that `tuning_config["num_threads"]` sets its thread count.

    The rest of the tuning config is passed on when `impl` takes a `tuning_config` argument; a lowering without
    other knobs need not declare one.
    """
    passes_config = "tuning_config" in inspect.signature(impl).parameters

    @functools.wraps(impl)
    def run(*args, tuning_config: Optional[dict] = None, **kwargs):
        if passes_config:
            kwargs["tuning_config"] = tuning_config
        with intra_op_threads(threads_of(tuning_config)):
            return impl(*args, **kwargs)

    return run


def _not_the_current_count(config: dict, problem: Problem) -> Optional[str]:
    if config.get(KNOB) == torch.get_num_threads():
        return "the current thread count: the same run as the default (None)"
    return None


def with_thread_axis(space: SearchSpace, counts: Optional[tuple[int, ...]] = None) -> SearchSpace:
    """`space` with the `num_threads` axis added; its default keeps the other knobs and the process's count (None)."""
    base_default = space.default

    def default(problem: Problem) -> dict:
        return {**base_default(problem), KNOB: None}

    axes = {**space.axes, KNOB: (None,) + (counts if counts is not None else thread_counts())}
    return dataclasses.replace(space, axes=axes, default=default,
                               constraints=tuple(space.constraints) + (_not_the_current_count,))
