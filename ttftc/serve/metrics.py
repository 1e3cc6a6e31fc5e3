"""The server's Prometheus metrics, in a registry of its own (two servers in one process do not mix figures).

Latencies are taken where the client sees them: TTFT from the moment the request reached its handler to the
moment its first token chunk was handed to the socket; inter-token latency between consecutive token chunks.
Queue time and prefill tokens come from the scheduler's record of the request. Gauges are read at scrape time.

The TTFT estimate (runtime/ttft_estimate.py) is recorded next to the TTFT it predicted, for every request that
was admitted: `ttftc_estimated_time_to_first_token_seconds` beside `ttftc_time_to_first_token_seconds`, and the
relative error (estimated - actual) / actual, signed (a negative error is a promise broken) and absolute.

While the buckets compile in the background (`ttftc serve` starts serving before they are ready), the buckets
still compiling, compiled and failed are gauges, with whether the KV path runs compiled yet and how many prompts
ran in a bucketed graph: a bucket's switch-over shows as that count moving. `ttftc_graph_compiles_total` counts the
graphs this process compiled and `ttftc_graph_cache_loads_total` those it loaded from the compile cache instead (a
restart on a warm cache shows loads and no compiles); `ttftc_warm` is 1 once every graph the server uses is ready.
"""

from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 (re-exported for the app)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_ERROR_BUCKETS = (-0.9, -0.75, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
_ABS_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 4.0)


class ServerMetrics:
    """The server's series. `stats` is the LLM's snapshot (LLM.stats): the gauges read one snapshot per scrape."""

    def __init__(self, stats: Callable[[], dict]):
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
        self.estimated_ttft = Histogram("ttftc_estimated_time_to_first_token_seconds",
                                        "TTFT estimated at admission, of requests admitted", buckets=_LATENCY_BUCKETS,
                                        registry=r)
        self.estimate_error = Histogram("ttftc_ttft_estimate_relative_error",
                                        "(estimated - actual) / actual TTFT", buckets=_ERROR_BUCKETS, registry=r)
        self.estimate_abs_error = Histogram("ttftc_ttft_estimate_abs_relative_error",
                                            "|estimated - actual| / actual TTFT", buckets=_ABS_ERROR_BUCKETS,
                                            registry=r)
        self.shed = Counter("ttftc_requests_shed", "Requests refused with 429 because their estimated TTFT missed "
                            "the SLO, by whether their priority is shed first", ["priority_class"], registry=r)
        r.register(_EngineSeries(stats))

    def finished(self, completion) -> None:
        """Record what the scheduler measured for one request that ran."""
        self.requests.labels(completion.finish_reason).inc()
        self.generated.inc(len(completion.token_ids))
        if completion.queue_s is not None:
            self.queue_time.observe(completion.queue_s)
            self.prefill_computed.observe(completion.prompt_tokens - completion.cached_tokens)
            self.prefill_cached.observe(completion.cached_tokens)

    def first_token(self, actual_s: float, estimated_s: Optional[float]) -> None:
        self.ttft.observe(actual_s)
        if estimated_s is None or actual_s <= 0:
            return
        self.estimated_ttft.observe(estimated_s)
        error = (estimated_s - actual_s) / actual_s
        self.estimate_error.observe(error)
        self.estimate_abs_error.observe(abs(error))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineSeries:
    """The series read from the LLM at scrape time, all from one `stats()` snapshot (prometheus_client's Counter can
    only be incremented, and these figures live in the engine, the cache and the compile code, which know nothing of
    metrics)."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        cache, disk, status, cost = s["prefix_cache"], s["disk"], s["compile"], s["cost_model"]
        yield _gauge("ttftc_requests_running", "Sequences in prefill or decode", s["running"])
        yield _gauge("ttftc_requests_waiting", "Requests not yet admitted (batching window, no free slot)",
                     s["waiting"])
        yield _gauge("ttftc_prefix_cache_bytes", "Bytes of KV held by the prefix cache", s["prefix_cache_bytes"])
        yield _gauge("ttftc_kv_tokens", "Tokens of KV held by requests in flight", s["kv_tokens"])
        yield _gauge("ttftc_prefix_cache_pinned_tokens", "Prompt tokens pinned in the prefix cache (warm prompts)",
                     cache.pinned_tokens if cache is not None else 0)
        yield _gauge("ttftc_prefix_cache_pinned_prompts", "Prompts pinned in the prefix cache (warm prompts)",
                     cache.pinned_prompts if cache is not None else 0)
        if disk is not None:
            yield _labelled("ttftc_prefix_cache_disk", "The prefix cache's disk tier: blocks and bytes held; blocks "
                            "stored, loaded on a hit, declined on a hit (recomputing measured faster), refused as "
                            "invalid", "quantity",
                            {q: disk[q] for q in ("blocks", "bytes", "stored", "loaded", "declined", "refused")})
        for state in ("compiling", "compiled", "failed"):
            yield _gauge(f"ttftc_buckets_{state}", f"Prompt-length buckets whose graphs are {state} (background "
                         "compile)", status[f"buckets_{state}"])
        yield _gauge("ttftc_kv_path_compiled", "1 once the KV path (decode, cached prefixes) runs compiled, else 0",
                     float(status["kv_path"] in ("compiled", "ready")))
        yield _gauge("ttftc_warm", "1 once every graph the server uses is ready (nothing left to compile), else 0",
                     float(status["warm"]))
        yield CounterMetricFamily("ttftc_graph_compiles", "Graphs this process compiled (traced, passes, lowering)",
                                  value=status["graphs_compiled"])
        yield CounterMetricFamily("ttftc_graph_cache_loads", "Graphs loaded from the compile cache instead of "
                                  "compiled", value=status["graphs_loaded"])
        yield _gauge("ttftc_bucketed_prefill_prompts", "Prompts whose first stretch ran in a bucketed graph, since "
                     "start", s["bucketed_prompts"])
        yield _labelled("ttftc_cost_model", "The TTFT cost model's fit: seconds per prefill forward, token, token x "
                        "context token; per decode step and row; per step outside its forwards", "term",
                        {t: cost[t] for t in ("forward_s", "token_s", "attend_s", "step_s", "row_s", "overhead_s")})


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=float(value))


def _labelled(name: str, text: str, label: str, values: dict) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=[label])
    for key, value in values.items():
        family.add_metric([key], float(value))
    return family
