"""`ttftc loadtest URL`: Poisson arrivals of streamed completions against an OpenAI-compatible server, through the
`openai` client itself (nothing of ttftc's on the client path), timed the way an operator reads a dashboard.

Requests. Each prompt is `--prompt-len` random token ids (sent as ids, so any served model takes them), of which
the first `--shared-prefix` are the same for every request (a system prompt). With `--long-prompt-len L`, one
L-token prompt is sent right after the first request: the mixed short/long workload that chunked prefill is
for. Its figures are reported apart; the headline figures are the short requests'. `--long-every S` sends
another L-token prompt every S seconds after that one, for as long as arrivals last: with one long prompt per
run, the p95 of the short requests is decided by the two or three of them that land behind it, and moves a lot
from run to run; with one every S seconds, about (long prefill time) / S of the short requests meet one.

Arrivals. `--rate R` requests per second as a Poisson process for `--duration` seconds; `--rate inf` is a closed
loop instead: `--concurrency` clients each send their next request as soon as the last one ended, which
measures capacity. With a finite rate, `--concurrency` caps the requests in flight; one that finds no free slot
waits, and that wait counts in its TTFT.

Timing. TTFT runs from a request's scheduled arrival to the first streamed chunk that carries a token;
inter-token latency is the gap between consecutive token chunks; goodput is the rate of requests that completed
within `--slo-ttft-ms`. Every request has a timeout and the run has a deadline, so a stuck server cannot hang it.

Admission control. A server with an SLO (`ttftc serve --slo-ttft-ms`) answers some requests with 429 at once: they
are counted apart from errors ("rejected"), with the latency of the refusal and the Retry-After they got, and they
count against goodput (a request refused is a request not served within the SLO). The TTFT estimate a ttftc server
sends with each response (`x-ttftc-estimated-ttft-ms`) is compared with the TTFT this client measured from the
moment it sent the request (the server's estimate starts there too): the report gives the median absolute
relative error. `--compare URL2` runs the same load (same seed: the same arrivals and prompts) against a second
server afterwards, e.g. one started with an SLO and one without, and reports the two side by side.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from ttftc.stats import percentile

ESTIMATE_HEADER = "x-ttftc-estimated-ttft-ms"  # ttftc.serve.app.ESTIMATE_HEADER: a client reads it off the wire


@dataclass(frozen=True)
class LoadSpec:
    url: str
    rate: float  # requests per second; math.inf: closed loop
    duration_s: float
    prompt_len: int = 128
    shared_prefix: int = 0
    max_tokens: int = 32
    concurrency: int = 64
    slo_ttft_ms: float = 700.0
    long_prompt_len: int = 0
    long_every_s: float = 0.0  # 0: one long prompt per run
    long_priority: Optional[int] = None  # the long prompts' request `priority` (lower runs sooner); None: not sent
    model: Optional[str] = None  # None: the first model the server lists
    headers: tuple[tuple[str, str], ...] = ()
    seed: int = 0
    request_timeout_s: float = 300.0
    vocab_size: Optional[int] = None  # None: from the server's model card, else 32000
    max_requests: int = 100_000

    def __post_init__(self):
        if not self.rate > 0:
            raise ValueError(f"--rate must be positive (or inf), got {self.rate}")
        if not 0 < self.duration_s < math.inf:
            raise ValueError(f"--duration must be a positive number of seconds, got {self.duration_s}")
        if self.prompt_len < 1 or self.max_tokens < 1 or self.concurrency < 1:
            raise ValueError("--prompt-len, --max-tokens and --concurrency must be positive")
        if not 0 <= self.shared_prefix <= self.prompt_len:
            raise ValueError(f"--shared-prefix must be between 0 and --prompt-len ({self.prompt_len})")
        if self.long_prompt_len < 0:
            raise ValueError("--long-prompt-len must be >= 0")
        if not 0 <= self.long_every_s < math.inf:
            raise ValueError(f"--long-every must be a finite number of seconds >= 0, got {self.long_every_s}")
        if self.long_every_s and not self.long_prompt_len:
            raise ValueError("--long-every needs --long-prompt-len")
        if self.long_priority is not None and not self.long_prompt_len:
            raise ValueError("--long-priority needs --long-prompt-len")


@dataclass
class RequestResult:
    index: int
    kind: str  # "short" or "long"
    prompt_tokens: int
    scheduled_s: float  # from the start of the run
    sent_s: Optional[float] = None
    first_token_s: Optional[float] = None
    end_s: Optional[float] = None
    token_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: Optional[int] = None
    error: Optional[str] = None
    rejected: bool = False  # answered 429 (admission control); its latency is end_s - scheduled_s
    retry_after_s: Optional[float] = None
    estimated_ttft_ms: Optional[float] = None  # the server's estimate (header), from when the request was sent

    @property
    def ttft_s(self) -> Optional[float]:
        return None if self.first_token_s is None else self.first_token_s - self.scheduled_s

    @property
    def ok(self) -> bool:
        return self.error is None and not self.rejected and self.first_token_s is not None

    @property
    def estimate_error(self) -> Optional[float]:
        """(estimated - measured) / measured TTFT, both from the moment the request was sent."""
        if self.estimated_ttft_ms is None or not self.ok or self.sent_s is None:
            return None
        measured_ms = (self.first_token_s - self.sent_s) * 1e3
        return (self.estimated_ttft_ms - measured_ms) / measured_ms if measured_ms > 0 else None


def openai_module():
    """The `openai` package, the client every measurement of a server here drives it with."""
    import openai  # lazy: a dependency of the [dev] extra, not of ttftc; only the clients that measure need it

    return openai


def _prompt(rng: random.Random, shared: list[int], length: int, vocab: int) -> list[int]:
    return shared + [rng.randrange(vocab) for _ in range(length - len(shared))]


def _header_number(headers, name: str) -> Optional[float]:
    try:
        value = float(headers.get(name))
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value >= 0 else None


async def _one(client, model: str, spec: LoadSpec, result: RequestResult, prompt: list[int], start: float,
               headers: dict) -> None:
    body = {"ignore_eos": True}
    if result.kind == "long" and spec.long_priority is not None:
        body["priority"] = spec.long_priority
    rate_limited = openai_module().RateLimitError
    result.sent_s = time.perf_counter() - start
    try:
        async with client.completions.with_streaming_response.create(
                model=model, prompt=prompt, max_tokens=spec.max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body=body, extra_headers=headers,
                timeout=spec.request_timeout_s) as response:
            result.estimated_ttft_ms = _header_number(response.headers, ESTIMATE_HEADER)
            async for chunk in await response.parse():
                now = time.perf_counter() - start
                if chunk.usage is not None:
                    details = chunk.usage.prompt_tokens_details
                    result.cached_tokens = getattr(details, "cached_tokens", None) if details is not None else None
                for choice in chunk.choices:
                    ids = (choice.model_extra or {}).get("token_ids") or []
                    if choice.text or ids:
                        if result.first_token_s is None:
                            result.first_token_s = now
                        result.token_times_s.append(now)
                        result.output_tokens += max(1, len(ids))
    except rate_limited as exc:  # refused by admission control: a result of its own, not an error
        result.rejected = True
        result.retry_after_s = _header_number(exc.response.headers, "retry-after")
        result.estimated_ttft_ms = _header_number(exc.response.headers, ESTIMATE_HEADER)
    except Exception as exc:  # a failed request is a result, not a crash of the run
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.end_s = time.perf_counter() - start


async def _discover(client, spec: LoadSpec) -> tuple[str, int]:
    page = await client.models.list()
    cards = list(page.data)
    if not cards:
        raise RuntimeError(f"{spec.url} lists no models")
    card = next((c for c in cards if c.id == spec.model), None) if spec.model else cards[0]
    if card is None:
        raise RuntimeError(f"{spec.url} does not serve {spec.model!r}; it serves {[c.id for c in cards]}")
    vocab = spec.vocab_size or (card.model_extra or {}).get("vocab_size") or 32000
    return card.id, int(vocab)


async def run_load(spec: LoadSpec) -> dict:
    """Run the load described by `spec` and return the report document (see loadtest_report)."""
    client = openai_module().AsyncOpenAI(base_url=spec.url.rstrip("/") + "/v1", api_key="ttftc-loadtest", max_retries=0,
                                timeout=spec.request_timeout_s)
    try:
        model, vocab = await _discover(client, spec)
        rng = random.Random(spec.seed)
        shared = [rng.randrange(vocab) for _ in range(spec.shared_prefix)]
        headers = dict(spec.headers)
        results: list[RequestResult] = []
        tasks: list[asyncio.Task] = []
        slots = asyncio.Semaphore(spec.concurrency)
        start = time.perf_counter()

        async def send(result: RequestResult, prompt: list[int]) -> None:
            async with slots:
                await _one(client, model, spec, result, prompt, start, headers)

        def launch(kind: str, length: int, scheduled: float) -> asyncio.Task:
            result = RequestResult(len(results), kind, length, scheduled)
            results.append(result)
            prompt = _prompt(rng, shared if kind == "short" else [], length, vocab)
            tasks.append(asyncio.create_task(send(result, prompt)))
            return tasks[-1]

        if math.isinf(spec.rate):
            await _closed_loop(spec, launch, start)
        else:
            await _open_loop(spec, launch, rng, start)
        # Every request has its own timeout; this bounds the wait for the stragglers as well.
        done, pending = await asyncio.wait(tasks, timeout=spec.request_timeout_s + 5) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - start
    finally:
        await client.close()
    return summarize(spec, model, results, wall)


async def _open_loop(spec: LoadSpec, launch, rng: random.Random, start: float) -> None:
    t, sent = 0.0, 0
    next_long: Optional[float] = None  # when the next long prompt is due, once the first one went
    long_pending = spec.long_prompt_len > 0

    async def at(when: float) -> None:
        delay = when - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)

    def after(when: float) -> Optional[float]:
        due = when + spec.long_every_s
        return due if spec.long_every_s > 0 and due <= spec.duration_s else None

    while sent < spec.max_requests:
        t += rng.expovariate(spec.rate)
        if t > spec.duration_s:
            break
        while next_long is not None and next_long <= t:
            await at(next_long)
            launch("long", spec.long_prompt_len, next_long)
            next_long = after(next_long)
        await at(t)
        launch("short", spec.prompt_len, t)
        sent += 1
        if long_pending:  # right behind the first short request, so the ones after it meet it in the engine
            launch("long", spec.long_prompt_len, t + 1e-3)
            long_pending = False
            next_long = after(t + 1e-3)


async def _closed_loop(spec: LoadSpec, launch, start: float) -> None:
    """`concurrency` clients back to back until the duration is over; each waits for its own previous request."""
    if spec.long_prompt_len:
        launch("long", spec.long_prompt_len, 0.0)
    budget = [spec.max_requests]

    async def client_loop() -> None:
        while time.perf_counter() - start < spec.duration_s and budget[0] > 0:
            budget[0] -= 1
            done, _ = await asyncio.wait({launch("short", spec.prompt_len, time.perf_counter() - start)},
                                         timeout=spec.request_timeout_s + 5)
            if not done:
                return

    await asyncio.gather(*(client_loop() for _ in range(spec.concurrency)))


def _stats_ms(values_s: list[float]) -> dict:
    if not values_s:
        return {"n": 0, "p50": None, "p95": None, "p99": None, "mean": None, "max": None}
    ms = [v * 1e3 for v in values_s]
    return {"n": len(ms), "p50": percentile(ms, 50), "p95": percentile(ms, 95), "p99": percentile(ms, 99),
            "mean": sum(ms) / len(ms), "max": max(ms)}


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def summarize(spec: LoadSpec, model: str, results: list[RequestResult], wall_s: float) -> dict:
    short = [r for r in results if r.kind == "short"]
    ok = [r for r in short if r.ok]
    ttfts = [r.ttft_s for r in ok]
    gaps = [b - a for r in ok for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    e2e = [r.end_s - r.scheduled_s for r in ok if r.end_s is not None]
    span = max([spec.duration_s] + [r.end_s for r in results if r.end_s is not None]) if not math.isinf(
        spec.rate) else wall_s
    good = [r for r in ok if r.ttft_s * 1e3 <= spec.slo_ttft_ms]
    rejected = [r for r in short if r.rejected]
    errors = [r.estimate_error for r in short if r.estimate_error is not None]
    longs = [r for r in results if r.kind == "long"]
    settings = asdict(spec)
    settings["rate"] = "inf" if math.isinf(spec.rate) else spec.rate
    settings["headers"] = [name for name, _ in spec.headers]  # values may be credentials: names only
    return {
        "schema": "ttftc-loadtest/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": model,
        "settings": settings,
        "summary": {
            "requests": len(short),
            "completed": len(ok),
            "errors": len(short) - len(ok) - len(rejected),
            "rejected": len(rejected),
            "rejected_ms": _stats_ms([r.end_s - r.scheduled_s for r in rejected if r.end_s is not None]),
            "retry_after_s_mean": _mean([r.retry_after_s for r in rejected if r.retry_after_s is not None]),
            "wall_s": wall_s,
            "throughput_rps": len(ok) / span if span > 0 else None,
            "output_tokens_per_s": sum(r.output_tokens for r in ok) / span if span > 0 else None,
            "goodput_rps": len(good) / span if span > 0 else None,
            "slo_attainment": len(good) / len(short) if short else None,
            "ttft_ms": _stats_ms(ttfts),
            "itl_ms": _stats_ms(gaps),
            "e2e_ms": _stats_ms(e2e),
            "cached_tokens_mean": (sum(r.cached_tokens or 0 for r in ok) / len(ok)) if ok else None,
            "estimate": {
                "n": len(errors),
                "abs_rel_error_p50": percentile([abs(e) for e in errors], 50) if errors else None,
                "abs_rel_error_p95": percentile([abs(e) for e in errors], 95) if errors else None,
                "rel_error_p50": percentile(errors, 50) if errors else None,
            },
        },
        "long": [{"prompt_tokens": r.prompt_tokens, "scheduled_s": r.scheduled_s,
                  "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1e3, "error": r.error} for r in longs],
        "first_errors": sorted({r.error for r in results if r.error})[:5],
        "requests": [
            {"index": r.index, "kind": r.kind, "scheduled_s": r.scheduled_s, "sent_s": r.sent_s,
             "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1e3, "end_s": r.end_s,
             "output_tokens": r.output_tokens, "cached_tokens": r.cached_tokens, "error": r.error,
             "rejected": r.rejected, "retry_after_s": r.retry_after_s, "estimated_ttft_ms": r.estimated_ttft_ms}
            for r in results
        ],
    }
