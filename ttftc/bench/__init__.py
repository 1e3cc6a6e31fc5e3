"""`ttftc bench`: time to first token of one model under several compilers, with a roofline bound.

    from ttftc.bench import BenchSettings, run_bench
    doc = run_bench(BenchSettings(model="tiny", seqs=(32, 64), variants=("eager-sdpa", "ttftc-fp32")))

Modules, one concept each:
    models      which model (preset or local HF directory), and the prefill call every variant is timed on
    variants    how each compared variant is built (eager, Inductor, torchao, ttftc with a Config)
    ablation    ttftc's passes switched on one at a time, as variants
    workloads/  plug-ins that turn a length into requests (a single prompt; shared prefixes, chats, arrivals)
    timing      clocks, device sync and percentiles
    roofline    FLOPs of a prefill and the GEMM peaks measured in the same run
    caches      fresh, temporary compile-cache directories
    cold_start  the fresh process that measures a first call with cold caches
    runner      the interleaved measurement loop that produces the JSON document
    report      JSON, Markdown and PNG output
    serve_overhead  what `ttftc serve`'s HTTP layer adds to TTFT (python -m ttftc.bench.serve_overhead)
"""

from ttftc._lazy import lazy_exports

# Resolved on first use: `python -m ttftc.bench.cold_start` imports this package before it runs that module, and
# a runner imported here would import cold_start first (runpy then runs a second copy); `explain` and `autotune`,
# which use models and roofline, do not load the harness either.
_LAZY = {
    "BenchInputError": "ttftc.bench.errors",
    "BenchSettings": "ttftc.bench.runner",
    "run_bench": "ttftc.bench.runner",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
