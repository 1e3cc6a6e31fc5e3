"""The default workload: one prompt of --seq tokens per run, the same prompt every run."""

from __future__ import annotations

from ttftc.bench.workloads.base import Request, Workload, WorkloadContext
from ttftc.bench.workloads.registry import register_workload


@register_workload
class SinglePrompt(Workload):
    name = "single-prompt"
    description = "one prompt of --seq tokens per run, batch 1, no reuse between runs"

    def requests(self, ctx: WorkloadContext) -> list[Request]:
        # The same tokens every run, so every repeat does exactly the same work.
        return [Request(ctx.prompt(ctx.seq, seed=0))]
