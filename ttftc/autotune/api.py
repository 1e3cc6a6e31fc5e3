"""`tune_model`: compile a model at each bucket length, collect its ttftc op instances, tune them, cache results."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ttftc.autotune.cache import AutotuneCache
from ttftc.autotune.tuner import TuneResult, collect_problems, tune_instances
from ttftc.dynamo_backend import TtftcBackend
from ttftc.config import Config
from ttftc.ops.registry import all_ops


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
) -> list[TuneResult]:
    """Tune every ttftc op instance `model` compiles to at each prompt length in `buckets`."""
    wanted = check_ops(ops)
    Config(buckets=tuple(buckets))  # the same validation, and the same message, as everywhere else
    if not budget_s > 0:
        raise ValueError(f"autotune budget must be positive seconds, got {budget_s!r}")
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
    return tune_instances(instances, cache=cache, budget_s=budget_s, device=device, timer=timer, retune=retune,
                          progress=progress)
