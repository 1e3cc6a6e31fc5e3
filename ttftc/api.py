"""The user-facing entry points: compile and explain."""

from __future__ import annotations

from typing import Optional

import torch

from ttftc.bucketed import compile_bucketed
from ttftc.buckets.compiled import CompiledGraphs
from ttftc.config import Config
from ttftc.dynamo_backend import TtftcBackend
from ttftc.regions.backend import RegionalBackend
from ttftc.report import Report


def backend_for(config: Optional[Config] = None) -> TtftcBackend:
    """The backend `config` asks for: regional compilation (Config.regions) or the whole-graph one."""
    if config is not None and config.regions != "off":
        return RegionalBackend(config)
    return TtftcBackend(config)


def compile(model: torch.nn.Module, config: Optional[Config] = None):  # noqa: A001  (mirrors torch.compile)
    """`torch.compile(model, backend=ttftc.backend(config))`, with the argument checks a user deserves."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"ttftc.compile expects a torch.nn.Module (e.g. a transformers model), got {type(model).__name__}. "
            "For a plain function use torch.compile(fn, backend='ttftc')."
        )
    if config is not None and config.buckets is not None:
        # Shape buckets: a wrapper that pads each prompt to its bucket and runs that bucket's graph directly.
        return compile_bucketed(model, config)
    return torch.compile(model, backend=backend_for(config))


def explain(model, *args, config: Optional[Config] = None, **kwargs) -> Report:
    """Compile `model`, run it once on the given inputs under no_grad, and report what every pass did.

    Resets Dynamo's caches first, so the report describes a fresh compile (and the recompile limit of an
    earlier session of compiles cannot silently turn this one into eager).
    """
    if not callable(model):
        raise TypeError(f"ttftc.explain expects a model or callable, got {type(model).__name__}")
    backend = backend_for(config)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    # A graph Inductor loads from its cache skips the post-grad pass that would report on it.
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        compiled(*args, **kwargs)
    report = backend.report()
    if config is not None and config.buckets is not None and isinstance(model, torch.nn.Module):
        report.notes.append(CompiledGraphs(model, config).plan.describe())
    if not backend.reports:
        report.notes.append("Dynamo handed ttftc no graph: nothing was compiled")
    return report
