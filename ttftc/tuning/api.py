"""`tune_model`: compile a model at each bucket length, collect its ttftc op instances, tune them, cache results;
optionally then tune the chunk size of chunked prefill per bucket (tuning/chunking.py)."""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from ttftc.autotune.cache import AutotuneCache
from ttftc.config import Config
from ttftc.dynamo_backend import TtftcBackend
from ttftc.ops.registry import all_ops
from ttftc.tuning.chunking import TOLERANCE, tune_chunk_sizes
from ttftc.tuning.tuner import TuneResult, collect_problems, tune_instances


def check_ops(ops: Optional[Sequence[str]]) -> Optional[tuple[str, ...]]:
    if ops is None:
        return None
    known = sorted(all_ops())
    for op in ops:
        if op not in known:
            raise ValueError(f"unknown op {op!r} in --ops; known ttftc ops: {', '.join(known)}")
    return tuple(ops)


def tune_model(
    model: torch.nn.Module,
    buckets: Sequence[int],
    *,
    config: Optional[Config] = None,
    cache: Optional[AutotuneCache] = None,
    budget_s: float = 300.0,
    ops: Optional[Sequence[str]] = None,
    timer: Optional[Callable] = None,
    retune: bool = False,
    progress: bool = True,
    chunk_sizes: Optional[Sequence[int]] = None,
) -> list[TuneResult]:
    """Tune every ttftc op instance `model` compiles to at each prompt length in `buckets`.

    With `chunk_sizes`, then time chunked prefill (ttftc.runtime.PrefillEngine on the model compiled with
    `config`, reading the kernel configs just tuned) at each bucket length with each of those chunk sizes and the
    whole prompt, within what is left of the budget, and cache the fastest per bucket.
    """
    wanted = check_ops(ops)
    Config(buckets=tuple(buckets))  # the same validation, and the same message, as everywhere else
    if not budget_s > 0:
        raise ValueError(f"autotune budget must be positive seconds, got {budget_s!r}")
    if chunk_sizes is not None and (not chunk_sizes or any(int(c) < 1 for c in chunk_sizes)):
        raise ValueError(f"chunk sizes must be positive integers, got {list(chunk_sizes)!r}")
    cache = cache or AutotuneCache()
    cache.check_writable()
    config = config or Config()
    device = next(model.parameters()).device.type
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    instances = []
    for bucket in buckets:
        backend = TtftcBackend(config)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, dynamic=False)
        ids = torch.randint(0, vocab or 2, (1, bucket), generator=torch.Generator().manual_seed(bucket))
        with torch.inference_mode():
            compiled(input_ids=ids.to(device), logits_to_keep=1)
        found = collect_problems(backend.graph_modules, bucket)
        instances.extend(i for i in found if wanted is None or i.problem.op in wanted)
    torch._dynamo.reset()
    started = time.monotonic()
    results = tune_instances(instances, cache=cache, budget_s=budget_s, device=device, timer=timer, retune=retune,
                             progress=progress)
    if chunk_sizes:
        results += _tune_chunks(model, buckets, chunk_sizes, config=config, cache=cache,
                                budget_s=budget_s - (time.monotonic() - started), timer=timer, retune=retune,
                                progress=progress)
    return results


def _tune_chunks(model, buckets, chunk_sizes, *, config: Config, cache: AutotuneCache, budget_s: float, timer,
                 retune: bool, progress: bool) -> list[TuneResult]:
    compiled = torch.compile(model, backend=TtftcBackend(config, autotune_cache=cache))
    # Every chunk size and KV length is a new shape to Dynamo: allow the recompiles rather than fall back to eager.
    try:
        with torch._dynamo.config.patch(recompile_limit=64), torch.inference_mode():
            return tune_chunk_sizes(compiled, buckets, chunk_sizes, cache=cache, budget_s=budget_s,
                                    tolerance=TOLERANCE[config.precision], timer=timer, progress=progress,
                                    retune=retune)
    finally:
        torch._dynamo.reset()
