"""The server's Prometheus metrics, in a registry of its own (two servers in one process do not mix figures).

Latencies are taken where the client sees them: TTFT from the moment the request reached its handler to the
moment its first token chunk was handed to the socket; inter-token latency between consecutive token chunks.
Queue time and prefill tokens come from the scheduler's record of the request. Gauges are read at scrape time.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 (re-exported for the app)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics:
    def __init__(self, *, running: Callable[[], float], waiting: Callable[[], float],
                 prefix_cache_bytes: Callable[[], float], kv_tokens: Callable[[], float]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("ttftc_time_to_first_token_seconds", "Handler arrival to first token chunk sent",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ttftc_inter_token_latency_seconds", "Time between consecutive token chunks",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("ttftc_queue_time_seconds", "Arrival to the first forward of the prompt",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_computed = Histogram("ttftc_prefill_tokens_computed", "Prompt tokens run through the model",
                                          buckets=_TOKEN_BUCKETS, registry=r)
        self.prefill_cached = Histogram("ttftc_prefill_tokens_cached", "Prompt tokens served from the prefix cache",
                                        buckets=_TOKEN_BUCKETS, registry=r)
        self.requests = Counter("ttftc_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.errors = Counter("ttftc_request_errors", "Requests refused, by HTTP status", ["status"], registry=r)
        self.generated = Counter("ttftc_generation_tokens", "Tokens generated", registry=r)
        Gauge("ttftc_requests_running", "Sequences in prefill or decode", registry=r).set_function(running)
        Gauge("ttftc_requests_waiting", "Requests not yet admitted (batching window, no free slot)",
              registry=r).set_function(waiting)
        Gauge("ttftc_prefix_cache_bytes", "Bytes of KV held by the prefix cache",
              registry=r).set_function(prefix_cache_bytes)
        Gauge("ttftc_kv_tokens", "Tokens of KV held by requests in flight", registry=r).set_function(kv_tokens)

    def finished(self, completion) -> None:
        """Record what the scheduler measured for one request that ran."""
        self.requests.labels(completion.finish_reason).inc()
        self.generated.inc(len(completion.token_ids))
        if completion.queue_s is not None:
            self.queue_time.observe(completion.queue_s)
            self.prefill_computed.observe(completion.prompt_tokens - completion.cached_tokens)
            self.prefill_cached.observe(completion.cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
