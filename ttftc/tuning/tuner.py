"""The tuner: for every ttftc op instance a model compiles to, per bucket, search its provider's space.

Each candidate runs once against the op's torch reference (a config that computes wrong numbers is discarded,
never chosen), then is timed. The default config is always measured first, so the summary can say what tuning
bought, and the search stops at the time budget.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ttftc.autotune.cache import AutotuneCache
from ttftc.autotune.keys import key_for
from ttftc.autotune.space import Problem, SearchSpace, random_inputs, space_for
import ttftc.codegen.providers  # noqa: F401  (importing it registers every lowering and search space)
from ttftc.codegen.registry import lowerings_for
from ttftc.ops.registry import all_ops, get_op
from ttftc.tuning.timing import WallTimer

# Tolerances for accepting a candidate's output against the reference, per output dtype.
_ACCEPT = {torch.float32: (1e-3, 1e-3), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}
# A candidate replaces the default only when its median is at least this much faster. Smaller measured gains are
# within the noise of a shared machine, and winners by noise alone were seen to run slower inside the whole model
# (benchmarks/README.md, autotune).
MIN_GAIN = 0.03


@dataclass
class TuneResult:
    problem: Problem
    bucket: Optional[int]
    status: str  # "tuned" | "cached" | "skipped: <why>"
    config: dict = field(default_factory=dict)
    tuned_ms: float = math.nan
    default_ms: float = math.nan
    tried: int = 0
    pruned: int = 0
    rejected: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.default_ms / self.tuned_ms if self.tuned_ms and not math.isnan(self.tuned_ms) else math.nan


def _close(actual: Any, expected: Any) -> bool:
    if isinstance(expected, (tuple, list)):
        return len(actual) == len(expected) and all(_close(a, e) for a, e in zip(actual, expected))
    if not isinstance(expected, torch.Tensor):
        return True
    if actual.shape != expected.shape:
        return False
    atol, rtol = _ACCEPT.get(expected.dtype, (1e-3, 1e-3))
    # The absolute tolerance scales with the output's typical (root-mean-square) magnitude: a GEMM over K=2816 that
    # sums to thousands differs from another correct GEMM by more than 1e-3 on its near-zero entries, from
    # reassociation alone. The RMS, not the max: a max-scaled bound let a bf16 GEMM with its bias dropped pass.
    scale = max(1.0, float(expected.float().pow(2).mean().sqrt())) if expected.numel() else 1.0
    return bool(torch.allclose(actual.float(), expected.float(), atol=atol * scale, rtol=rtol))


def tune_problem(
    problem: Problem,
    space: SearchSpace,
    impl: Callable,
    *,
    device: str,
    timer: Callable,
    deadline: float,
    bucket: Optional[int] = None,
    on_candidate: Callable[[], None] = lambda: None,
) -> TuneResult:
    args, kwargs = (space.make_inputs or random_inputs)(problem, device)
    expected = get_op(problem.op).reference(*args, **kwargs)
    allowed, pruned = space.candidates(problem)
    result = TuneResult(problem, bucket, "tuned", pruned=len(pruned))

    def run(config: dict) -> Callable[[], Any]:
        return lambda: impl(*args, **kwargs, tuning_config=config)

    measure_candidates(result, allowed, run, lambda out, index: _close(out, expected), timer=timer, deadline=deadline,
                       on_candidate=on_candidate, wrong="wrong numbers against the reference")
    return result


def measure_candidates(
    result: TuneResult,
    configs: Sequence[dict],
    run: Callable[[dict], Callable[[], Any]],
    is_correct: Callable[[Any, int], bool],
    *,
    timer: Callable,
    deadline: float,
    on_candidate: Callable[[], None],
    wrong: str,
) -> None:
    """Check and time each config (the default first, always measured; the rest while the deadline allows), then put
    the winner (best_over_default) in `result`. `run(config)` gives the call to time; `is_correct(output, index)`
    judges its first output. A config that raises or fails the check scores nothing and is listed as rejected."""
    timings: list[tuple[float, dict]] = []
    for index, config in enumerate(configs):
        if index > 0 and time.monotonic() > deadline:
            break
        on_candidate()
        result.tried += 1
        call = run(config)
        try:
            if not is_correct(call(), index):
                result.rejected.append(f"{config}: {wrong}")
                continue
            ms = timer(call, config)
        except Exception as exc:  # a config the hardware cannot run (e.g. out of memory) scores nothing
            result.rejected.append(f"{config}: {type(exc).__name__}: {exc}")
            continue
        if index == 0:
            result.default_ms = ms
        timings.append((ms, config))
    if not timings:
        result.status = "skipped: no candidate ran correctly"
        return
    result.tuned_ms, result.config = best_over_default(timings, result.default_ms)


def best_over_default(timings: Sequence[tuple[float, dict]], default_ms: float) -> tuple[float, dict]:
    """(ms, config) of the fastest candidate, unless it beats the default (timings[0]) by less than MIN_GAIN."""
    best_ms, best = min(timings, key=lambda t: t[0])
    if not math.isnan(default_ms) and best_ms > default_ms * (1.0 - MIN_GAIN):
        return timings[0]
    return best_ms, best


@dataclass(frozen=True)
class OpInstance:
    problem: Problem
    bucket: Optional[int]


def collect_problems(graph_modules: Iterable[torch.fx.GraphModule], bucket: Optional[int]) -> list[OpInstance]:
    """The distinct lowered ttftc op instances in compiled graphs (identical layers collapse to one)."""
    seen: dict[str, OpInstance] = {}
    for gm in graph_modules:
        for node in gm.graph.nodes:
            op, provider = node.meta.get("ttftc_op"), node.meta.get("ttftc_provider")
            if op is None or provider is None:
                continue
            args = tuple(a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args)
            kwargs = {
                k: (v.meta.get("val") if isinstance(v, torch.fx.Node) else v)
                for k, v in node.kwargs.items()
                if k != "tuning_config"
            }
            problem = Problem.from_meta(op, provider, args, kwargs)
            seen.setdefault(problem.signature() + provider + op, OpInstance(problem, bucket))
    return list(seen.values())


def _impl_for(op: str, provider: str) -> Optional[Callable]:
    return next((e.impl for e in lowerings_for(op) if e.provider == provider), None)


def tune_instances(
    instances: Sequence[OpInstance],
    *,
    cache: AutotuneCache,
    budget_s: float,
    device: str = "cpu",
    timer: Optional[Callable] = None,
    retune: bool = False,
    progress: bool = True,
) -> list[TuneResult]:
    if not budget_s > 0:
        raise ValueError(f"autotune budget must be positive seconds, got {budget_s!r}")
    cache.check_writable()
    timer = timer or WallTimer(device)
    deadline = time.monotonic() + budget_s
    work = []
    results = []
    for inst in instances:
        impl = _impl_for(inst.problem.op, inst.problem.provider)  # loads the providers, which register the spaces
        space = space_for(inst.problem.op, inst.problem.provider, device)
        if space is None or impl is None:
            results.append(TuneResult(inst.problem, inst.bucket, f"skipped: {inst.problem.provider} has no knobs"))
            continue
        cached = None if retune else cache.lookup(key_for(inst.problem, device), axes=space.axes)
        if cached is not None:
            results.append(TuneResult(inst.problem, inst.bucket, "cached", cached.config, cached.tuned_ms,
                                      cached.default_ms))
            continue
        work.append((inst, space, impl))
    total = sum(len(space.candidates(inst.problem)[0]) for inst, space, _ in work)
    bar = _progress(total, enabled=progress)
    try:
        for inst, space, impl in work:
            if time.monotonic() > deadline:
                results.append(TuneResult(inst.problem, inst.bucket, "skipped: time budget used up"))
                continue
            result = tune_problem(inst.problem, space, impl, device=device, timer=timer, deadline=deadline,
                                  bucket=inst.bucket, on_candidate=lambda: bar.update(1))
            if result.status == "tuned":
                cache.store(key_for(inst.problem, device), result.config, result.tuned_ms, result.default_ms)
            results.append(result)
    finally:
        bar.close()
    return results


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, *, enabled: bool):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm  # lazy: optional dependency (the bench extra); without it there is no progress bar
    except ImportError:
        return _NoProgress()
    # tqdm shows elapsed time and the ETA from the candidates left.
    return tqdm(total=total, desc="autotune", unit="cfg", file=sys.stderr, disable=not sys.stderr.isatty()
                and os.environ.get("TTFTC_PROGRESS") != "1")


def summary_table(results: Sequence[TuneResult]) -> str:
    op_w = max([len("op")] + [len(r.problem.op) for r in results]) + 2
    prov_w = max([len("provider")] + [len(r.problem.provider) for r in results]) + 2
    lines = [f"{'op':<{op_w}}{'provider':<{prov_w}}{'bucket':>7}{'default ms':>12}{'tuned ms':>10}{'speedup':>9}"
             "  config / status"]
    for r in results:
        bucket = "-" if r.bucket is None else str(r.bucket)
        detail = str(r.config) if r.status in ("tuned", "cached") else r.status
        if r.status == "cached":
            detail += " (cached)"
        lines.append(
            f"{r.problem.op:<{op_w}}{r.problem.provider:<{prov_w}}{bucket:>7}{r.default_ms:>12.3f}{r.tuned_ms:>10.3f}"
            f"{r.speedup:>9.2f}  {detail}"
        )
    return "\n".join(lines)


def known_ops() -> list[str]:
    return sorted(all_ops())
