"""Workloads: what the bench sends to a variant in one run. A plug-in registry.

The default, `single-prompt`, is one prompt of --seq tokens per run. Other workloads (a shared system prompt,
multi-turn chat, Poisson arrivals with mixed lengths) plug in here without touching the harness.

Writing a plug-in
-----------------
Add a module to this package (it is imported automatically; names starting with "_" are not):

    from ttftc.bench.workloads import Request, Workload, WorkloadContext, register_workload

    @register_workload
    class SharedSystemPrompt(Workload):
        name = "shared-system-prompt"                 # what --workload selects
        description = "8 users, one system prompt of --seq tokens, a short question each"

        def requests(self, ctx: WorkloadContext) -> list[Request]:
            system = ctx.prompt(ctx.seq, seed=0)
            return [Request(torch.cat([system, ctx.prompt(32, seed=ctx.seed * 100 + u)], dim=1), session=f"u{u}")
                    for u in range(8)]

        def make_server(self, target: ServeTarget) -> Server:   # optional; default: stateless full prefill
            cache = MyPrefixCache()                           # fresh for every run
            return lambda request: cache.first_token(target.model, request.ids)

The contract:
- `requests(ctx)` returns the requests of one run. `ctx.seq` is the row's nominal length, `ctx.seed` differs
  per repeat, `ctx.prompt(length, seed=...)` makes token ids on the right device. Requests either all carry
  an `arrival_s` (seconds from the start of the run; TTFT then includes queueing, as in a serving benchmark)
  or none do (issued back to back). `measured=False` marks set-up requests whose TTFT is not reported.
- `make_server(target)` is called once per run (each warm-up and each measured repeat), so state such as a
  prefix cache never carries from warm-up into a measurement. `target.model` is the variant's compiled
  model (any HF keyword arguments), `target.prefill(ids)` the plain first-token forward.
- The harness runs the requests with `replay` (one request at a time, first come first served) under
  `torch.inference_mode()`, pools the TTFTs of all measured requests over the repeats, and reports their
  percentiles in the row of (variant, --seq). `bound_ms` stays the bound of one cold prefill of --seq tokens,
  so a workload that reuses a prefix can show an efficiency above 1; that is the reuse, not an error.
- The first-call and unseen-length figures are always measured with a single prompt, whatever the workload.
- `table()` (optional) returns figures the rows cannot hold, gathered by the workload itself over the run; the
  harness stores them as `workload_table` and prints them after the rows (the `batch` workload's TTFT per batch
  size is one).
"""

from ttftc.bench.workloads.base import Request, Server, ServeTarget, Workload, WorkloadContext
from ttftc.bench.workloads.registry import get_workload, register_workload, workload_names
from ttftc.bench.workloads.replay import replay

DEFAULT_WORKLOAD = "single-prompt"

__all__ = [
    "DEFAULT_WORKLOAD",
    "Request",
    "ServeTarget",
    "Server",
    "Workload",
    "WorkloadContext",
    "get_workload",
    "register_workload",
    "replay",
    "workload_names",
]
