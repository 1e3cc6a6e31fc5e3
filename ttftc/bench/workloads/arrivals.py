"""Mixed arrivals: short prompts arriving as a Poisson process, one --seq-token prompt among them, one request
decoding throughout; served by ttftc.runtime's step scheduler, which interleaves prefill chunks with decodes.

`mixed-arrivals` prefills in chunks of CHUNK tokens; `mixed-arrivals-unchunked` prefills each prompt whole.
The measured TTFTs are the short requests' (queueing included); their p95 chunked/unchunked is the issue's
<= 0.4x target. The decoding request's worst stall is printed by `python -m ttftc.bench.runtime_workloads`.

Time scale: `arrival_s` here is in units of one short prefill. `replay` measures that prefill on the variant
first and rescales, so the offered load (LOAD of the server's capacity for short prompts) is the same on a
slow CPU and on a GPU. Idle time between arrivals is skipped on the clock, not slept.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Optional, Sequence

from ttftc.bench.runtime_workloads import TimedRequest, run_arrivals
from ttftc.bench.timing import synchronize
from ttftc.bench.workloads.base import Request, Server, ServeTarget, Workload, WorkloadContext
from ttftc.bench.workloads.registry import register_workload
from ttftc.runtime.engine import PrefillEngine
from ttftc.runtime.scheduler import Request as RuntimeRequest

SHORT_TOKENS = 64
N_SHORT = 16
LOAD = 0.3
CHUNK = 256


class SchedulerServer:
    """Holds the engine; called on its own it serves one request at a time (plain replay)."""

    def __init__(self, target: ServeTarget):
        self.engine = PrefillEngine(target.model)
        self.device = target.device

    def __call__(self, request: Request) -> int:
        first = self.engine.first_token(request.ids)
        first.kv.release()
        return first.token


@register_workload
class MixedArrivals(Workload):
    name = "mixed-arrivals"
    description = (f"{N_SHORT} Poisson-arriving {SHORT_TOKENS}-token prompts and one --seq-token prompt, step "
                   f"scheduler with {CHUNK}-token prefill chunks; short-request TTFT")
    chunk_size: Optional[int] = CHUNK

    def requests(self, ctx: WorkloadContext) -> list[Request]:
        rng = random.Random(ctx.seed)
        t, out = 0.0, []
        for i in range(N_SHORT):
            t += rng.expovariate(LOAD)  # mean gap 1/LOAD short-prefill times
            out.append(Request(ctx.prompt(SHORT_TOKENS, seed=ctx.seed * 1000 + i), arrival_s=t, session=f"short-{i}"))
        # The long prompt lands right after the first short one, so most short requests queue behind it.
        out.append(Request(ctx.prompt(ctx.seq, seed=ctx.seed * 1000 + 999), arrival_s=out[0].arrival_s + 1e-3,
                           session="long", measured=False))
        return sorted(out, key=lambda r: r.arrival_s)

    def make_server(self, target: ServeTarget) -> Server:
        return SchedulerServer(target)

    def replay(self, requests: Sequence[Request], server: Server, *, device: str = "cpu") -> list[float]:
        if not isinstance(server, SchedulerServer):
            return super().replay(requests, server, device=device)
        engine = server.engine
        probe = next(r.ids for r in requests if r.measured)
        server(Request(probe))  # warm the short shape
        scale = []
        for _ in range(2):
            synchronize(device)
            start = time.perf_counter()
            server(Request(probe))
            synchronize(device)
            scale.append(time.perf_counter() - start)
        unit = statistics.median(scale)
        timed = [TimedRequest(r.arrival_s * unit, RuntimeRequest(r.ids, max_new_tokens=2, request_id=k), r.measured)
                 for k, r in enumerate(requests)]
        background = RuntimeRequest(probe, max_new_tokens=1 << 30, request_id="decoding")
        budget = (self.chunk_size or CHUNK) + 2 * SHORT_TOKENS + 8
        records, _ = run_arrivals(engine, timed, token_budget=budget, chunk_size=self.chunk_size, background=background)
        return [rec.ttft for rec, t in zip(records, sorted(timed, key=lambda t: t.arrival_s)) if t.measured]


@register_workload
class MixedArrivalsUnchunked(MixedArrivals):
    name = "mixed-arrivals-unchunked"
    description = (f"the mixed-arrivals requests with every prompt prefilled whole (no chunking); "
                   "short-request TTFT")
    chunk_size = None
