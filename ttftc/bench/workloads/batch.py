"""TTFT against batch size: B prompts of --seq tokens in one prefill forward, for B in 1, 2, 4, 8, 16.

The table of the Ascend ATB seed (TTFT against batch size), for any variant. Every prompt of a batch gets its
first token when the one forward over the batch ends, so a batch's TTFT is the time of that forward; what batching
buys is throughput (per-prompt time falls while the batch's GEMMs get more efficient), and what it costs is the
TTFT of every prompt in it. A server's batching window (ttftc/runtime/scheduler.py) trades along this curve.

The row of (variant, --seq) keeps batch 1, so it reads like the single-prompt row; the whole table is
`workload_table` in the JSON (and a section of the terminal and Markdown output): per variant, length and
batch size, the TTFT percentiles and the time per prompt. The first run of each batch size for a variant is a
warm-up and is not counted (a compiled variant recompiles for a new batch size).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from ttftc.bench.timing import percentile, synchronize
from ttftc.bench.workloads.base import Request, Server, ServeTarget, Workload, WorkloadContext
from ttftc.bench.workloads.registry import register_workload

BATCH_SIZES = (1, 2, 4, 8, 16)


class _BatchServer:
    """One prefill per request; knows which variant it serves, so the table can be kept per variant."""

    def __init__(self, target: ServeTarget):
        self.target = target

    def __call__(self, request: Request) -> Any:
        return self.target.prefill(request.ids)


@register_workload
class BatchSizes(Workload):
    name = "batch"
    description = f"batches of {', '.join(map(str, BATCH_SIZES))} prompts of --seq tokens, one forward each"
    batch_sizes: Sequence[int] = BATCH_SIZES

    def __init__(self):
        self._samples: dict[tuple[str, int, int], list[float]] = {}
        self._warm: set[tuple[str, int, int]] = set()

    def requests(self, ctx: WorkloadContext) -> list[Request]:
        # Different prompts per row (a batch of one prompt repeated would be an unusual cache-friendly case).
        return [Request(torch.cat([ctx.prompt(ctx.seq, seed=ctx.seed * 100 + b * 17 + row) for row in range(b)]),
                        session=f"batch={b}", measured=b == 1)
                for b in self.batch_sizes]

    def make_server(self, target: ServeTarget) -> Server:
        return _BatchServer(target)

    def replay(self, requests: Sequence[Request], server: Server, *, device: str = "cpu") -> list[float]:
        variant = getattr(getattr(server, "target", None), "variant", "?")
        row_ttfts = []
        for request in requests:
            batch, seq = request.ids.shape
            synchronize(device)
            start = time.perf_counter()
            server(request)
            synchronize(device)
            seconds = time.perf_counter() - start
            key = (variant, seq, batch)
            if key not in self._warm:
                self._warm.add(key)  # the first run of a shape: compile and allocator warm-up, not counted
            else:
                self._samples.setdefault(key, []).append(seconds)
            if request.measured:
                row_ttfts.append(seconds)
        return row_ttfts

    def table(self) -> Optional[dict]:
        rows = []
        for (variant, seq, batch), samples in sorted(self._samples.items()):
            ms = [s * 1e3 for s in samples]
            p50 = percentile(ms, 50)
            rows.append({"variant": variant, "seq": seq, "batch": batch, "samples": len(ms), "ttft_ms_p50": p50,
                         "ttft_ms_p95": percentile(ms, 95), "ms_per_prompt_p50": p50 / batch})
        return {"kind": "batch", "batch_sizes": list(self.batch_sizes), "rows": rows} if rows else None
