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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 (re-exported for the app)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_ERROR_BUCKETS = (-0.9, -0.75, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
_ABS_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 4.0)


class ServerMetrics:
    def __init__(self, *, running: Callable[[], float], waiting: Callable[[], float],
                 prefix_cache_bytes: Callable[[], float], kv_tokens: Callable[[], float],
                 pinned_tokens: Callable[[], float] = lambda: 0, pinned_prompts: Callable[[], float] = lambda: 0,
                 cost_terms: Optional[Callable[[], dict]] = None, disk: Optional[Callable[[], dict]] = None,
                 compile_status: Optional[Callable[[], dict]] = None,
                 bucketed_prompts: Callable[[], float] = lambda: 0):
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
        Gauge("ttftc_prefix_cache_pinned_tokens", "Prompt tokens pinned in the prefix cache (warm prompts)",
              registry=r).set_function(pinned_tokens)
        Gauge("ttftc_prefix_cache_pinned_prompts", "Prompts pinned in the prefix cache (warm prompts)",
              registry=r).set_function(pinned_prompts)
        if disk is not None:
            tier = Gauge("ttftc_prefix_cache_disk", "The prefix cache's disk tier: blocks and bytes held; blocks stored, "
                         "loaded on a hit, declined on a hit (recomputing measured faster), refused as invalid",
                         ["quantity"], registry=r)
            for quantity in ("blocks", "bytes", "stored", "loaded", "declined", "refused"):
                tier.labels(quantity).set_function(lambda quantity=quantity: disk()[quantity])
        if compile_status is not None:
            for state in ("compiling", "compiled", "failed"):
                Gauge(f"ttftc_buckets_{state}", f"Prompt-length buckets whose graphs are {state} (background compile)",
                      registry=r).set_function(lambda state=state: compile_status()[f"buckets_{state}"])
            Gauge("ttftc_kv_path_compiled", "1 once the KV path (decode, cached prefixes) runs compiled, else 0",
                  registry=r).set_function(lambda: float(compile_status()["kv_path"] in ("compiled", "ready")))
            Gauge("ttftc_warm", "1 once every graph the server uses is ready (nothing left to compile), else 0",
                  registry=r).set_function(lambda: float(compile_status()["warm"]))
            r.register(_GraphCounts(compile_status))
        Gauge("ttftc_bucketed_prefill_prompts", "Prompts whose first stretch ran in a bucketed graph, since start",
              registry=r).set_function(bucketed_prompts)
        if cost_terms is not None:
            cost = Gauge("ttftc_cost_model", "The TTFT cost model's fit: seconds per prefill forward, token, token x "
                         "context token; per decode step and row; per step outside its forwards", ["term"], registry=r)
            for term in ("forward_s", "token_s", "attend_s", "step_s", "row_s", "overhead_s"):
                cost.labels(term).set_function(lambda term=term: cost_terms()[term])

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


class _GraphCounts:
    """Counters read from the LLM at scrape time (prometheus_client's Counter can only be incremented, and the counts
    live in the compile code, which knows nothing of metrics)."""

    _HELP = {"ttftc_graph_compiles": ("graphs_compiled", "Graphs this process compiled (traced, passes, lowering)"),
             "ttftc_graph_cache_loads": ("graphs_loaded", "Graphs loaded from the compile cache instead of compiled")}

    def __init__(self, compile_status: Callable[[], dict]):
        self.compile_status = compile_status

    def describe(self):
        return [CounterMetricFamily(name, text) for name, (_, text) in self._HELP.items()]

    def collect(self):
        status = self.compile_status()
        return [CounterMetricFamily(name, text, value=status[key]) for name, (key, text) in self._HELP.items()]
