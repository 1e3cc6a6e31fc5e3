"""Running one workload's requests against one server and timing each request's first token."""

from __future__ import annotations

import time
from typing import Sequence

from ttftc.bench.timing import synchronize
from ttftc.bench.workloads.request import Request, Server


def replay(requests: Sequence[Request], server: Server, *, device: str = "cpu") -> list[float]:
    """TTFT in seconds of every measured request, in issue order.

    The server handles one request at a time (a single prefill stream). A request with an arrival time waits
    for it when the server is idle and counts its TTFT from that arrival, queueing included; a request without
    one is issued when the previous one finished and counts from that moment.
    """
    timed = [r.arrival_s is not None for r in requests]
    if any(timed) and not all(timed):
        raise ValueError("a workload must give arrival times to all of its requests or to none")
    ordered = sorted(requests, key=lambda r: r.arrival_s) if all(timed) and requests else list(requests)
    ttfts = []
    start = time.perf_counter()
    for request in ordered:
        if request.arrival_s is not None:
            due = start + request.arrival_s
            idle = due - time.perf_counter()
            if idle > 0:
                time.sleep(idle)
            issued = due
        else:
            issued = time.perf_counter()
        server(request)
        synchronize(device)
        if request.measured:
            ttfts.append(time.perf_counter() - issued)
    return ttfts
