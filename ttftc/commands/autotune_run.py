"""`ttftc autotune` run: what the parsed arguments of ttftc/commands/autotune.py do."""

from __future__ import annotations

from ttftc.autotune.cache import AutotuneCache
from ttftc.bench.errors import BenchInputError
from ttftc.bench.models import load_model, resolve_model
from ttftc.commands import UsageError
from ttftc.config import Config
from ttftc.tuning.cpu_choices import remeasure
from ttftc.tuning.api import check_ops, tune_model
from ttftc.tuning.tuner import summary_table


def _show(cache) -> int:
    entries = list(cache.entries())
    print(f"{cache.directory}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
    op_w = max([12] + [len(e.key.op) + 2 for e in entries])
    prov_w = max([8] + [len(e.key.provider) + 2 for e in entries])
    for e in entries:
        speedup = e.default_ms / e.tuned_ms if e.tuned_ms else float("nan")
        print(f"{e.key.op:<{op_w}}{e.key.provider:<{prov_w}}{e.key.dtype:<9}{e.tuned_ms:>9.3f} ms  x{speedup:.2f}  "
              f"{e.config}  [{e.key.shapes}] [{e.key.device}] {e.versions}")
    return 0


def run(args) -> int:
    cache = AutotuneCache(args.cache)
    if args.show:
        return _show(cache)
    if args.cpu:
        path, lines = remeasure()
        print("\n".join(lines))
        print(f"stored: {path}")
        if args.model is None:
            return 0
    if args.model is None:
        raise UsageError("MODEL is required (a preset or a local model directory), unless --show is given")
    if not args.budget_s > 0:
        raise UsageError(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    try:
        check_ops(args.ops)
        spec = resolve_model(args.model)
        cache.check_writable()
    except (ValueError, BenchInputError, PermissionError) as exc:
        raise UsageError(str(exc)) from None
    model = load_model(spec)
    config = Config(precision=args.precision, provider=args.provider)
    results = tune_model(model, args.buckets, config=config, cache=cache, budget_s=args.budget_s, ops=args.ops,
                         retune=args.retune, chunk_sizes=args.chunk_sizes)
    print(summary_table(results))
    print(f"cache: {cache.directory}")
    return 0
