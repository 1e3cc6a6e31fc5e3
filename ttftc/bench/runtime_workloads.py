"""The runtime's TTFT workloads, measured in one process: shared system prompt, multi-turn chat, mixed arrivals.

    python -m ttftc.bench.runtime_workloads --model llama-135m            # all three, short runs
    python -m ttftc.bench.runtime_workloads --model tiny --only shared-prefix

Each function compares two arms of the same work inside one process, interleaved per repeat, and reports medians
and their ratio, because absolute times on a shared machine are noise. `ttftc bench` runs the same workloads as
plug-ins (ttftc/bench/workloads/: shared_prefix.py, chat.py, arrivals.py) next to the compiler variants.

- shared prefix: prompts of `prompt_len` tokens that share their first `shared_len`. Cold: the prompt on a cache
  miss (same engine, same prefix cache, a tenant that has nothing cached). Warm: another prompt with the same
  prefix after one request of the tenant cached it.
- chat: `turns` user turns of `turn_len` tokens, each followed by a `reply_len`-token decoded reply, in one
  ChatSession. Turn N's TTFT (its prefill only) vs a cold prefill of the same full history.
- mixed arrivals: short prompts arriving as a Poisson process, one `long_len`-token prompt among them, and one
  request decoding throughout. Run by the step scheduler with and without chunked prefill on the same arrival
  schedule; reports the short requests' p50/p95 TTFT and the decoding request's worst stall in each arm.
  Arrival rates are set relative to a measured short prefill (`load`), so the workload means the same on a slow
  CPU and on a GPU; idle time between arrivals is skipped on the clock, not slept.

Every figure says which side it belongs to; `hit_tokens` and `computed_tokens` show that reuse really happened.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ttftc import zoo
from ttftc.runtime.engine import PrefillEngine
from ttftc.runtime.prefix_cache import PrefixCache
from ttftc.runtime.scheduler import Request, RequestRecord, StepScheduler
from ttftc.runtime.sessions import ChatSession
from ttftc.stats import percentile


def random_tokens(vocab_size: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def _timed(fn: Callable, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def _ratio(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.median(a) / statistics.median(b)


# ---- shared system prompt ------------------------------------------------------------------------------------------


@dataclass
class SharedPrefixResult:
    prompt_len: int
    shared_len: int
    cold_s: list[float] = field(default_factory=list)
    warm_s: list[float] = field(default_factory=list)
    warm_cached_tokens: int = 0

    @property
    def ratio(self) -> float:
        """Median warm TTFT / median cold TTFT (the issue's target: <= 0.3 on llama-135m)."""
        return _ratio(self.warm_s, self.cold_s)


def shared_prefix(model, *, prompt_len: int = 2048, shared_len: int = 1536, repeats: int = 3, block_size: int = 16,
                  chunk_size: Optional[int] = None, seed: int = 0) -> SharedPrefixResult:
    geometry_engine = PrefillEngine(model)  # for the vocabulary and a warm-up call only
    vocab = geometry_engine.geometry.vocab_size
    cache = PrefixCache(budget_bytes=4 * prompt_len * geometry_engine.geometry.bytes_per_token(), block_size=block_size)
    engine = PrefillEngine(model, prefix_cache=cache, chunk_size=chunk_size)
    system = random_tokens(vocab, shared_len, seed)
    geometry_engine.first_token(system[:32]).kv.release()  # warm-up: first-call costs belong to neither arm
    result = SharedPrefixResult(prompt_len, shared_len)
    for r in range(repeats):
        tenant = f"shared-prefix-{seed}-{r}"  # a fresh namespace: the cold arm misses, honestly
        prompts = [system + random_tokens(vocab, prompt_len - shared_len, seed * 1000 + 2 * r + k) for k in (1, 2)]
        seconds, first = _timed(engine.first_token, prompts[0], tenant)
        assert first.cached_tokens == 0
        first.kv.release()
        result.cold_s.append(seconds)
        seconds, first = _timed(engine.first_token, prompts[1], tenant)
        result.warm_cached_tokens = first.cached_tokens
        first.kv.release()
        result.warm_s.append(seconds)
        cache.clear()
    return result


# ---- multi-turn chat -------------------------------------------------------------------------------------------


@dataclass
class ChatResult:
    turns: int
    history_len: int
    cold_s: list[float] = field(default_factory=list)
    last_turn_s: list[float] = field(default_factory=list)
    last_turn_computed_tokens: int = 0

    @property
    def ratio(self) -> float:
        """Median last-turn TTFT / median cold TTFT of the same history (target: <= 0.35 for 4 turns)."""
        return _ratio(self.last_turn_s, self.cold_s)


def chat(model, *, turns: int = 4, turn_len: int = 496, reply_len: int = 8, repeats: int = 2,
         chunk_size: Optional[int] = None, seed: int = 0) -> ChatResult:
    engine = PrefillEngine(model, chunk_size=chunk_size)
    vocab = engine.geometry.vocab_size
    engine.first_token(random_tokens(vocab, 32, seed)).kv.release()  # warm-up
    result = ChatResult(turns, 0)
    for r in range(repeats):
        user_turns = [random_tokens(vocab, turn_len, seed * 1000 + r * 100 + t) for t in range(turns)]
        with ChatSession(engine, tenant=f"chat-{r}") as session:
            for t in range(turns - 1):
                session.send(user_turns[t], max_new_tokens=reply_len)
            history = session.history + user_turns[-1]
            seconds, first = _timed(session.prefill, user_turns[-1])
            result.last_turn_s.append(seconds)
            result.last_turn_computed_tokens = first.computed_tokens
        result.history_len = len(history)
        seconds, first = _timed(engine.first_token, history)
        first.kv.release()
        result.cold_s.append(seconds)
    return result


# ---- mixed arrivals ----------------------------------------------------------------------------------------------


@dataclass
class ArrivalsArm:
    chunk_size: Optional[int]
    short_ttft_s: list[float]
    long_ttft_s: float
    decode_stall_s: float

    @property
    def short_p50_s(self) -> float:
        return percentile(self.short_ttft_s, 50)

    @property
    def short_p95_s(self) -> float:
        return percentile(self.short_ttft_s, 95)


@dataclass
class ArrivalsResult:
    long_len: int
    short_len: int
    n_short: int
    short_prefill_s: float
    unchunked: ArrivalsArm
    chunked: ArrivalsArm

    @property
    def ratio(self) -> float:
        """p95 short-request TTFT with chunking / without (target: <= 0.4)."""
        return self.chunked.short_p95_s / self.unchunked.short_p95_s


@dataclass(frozen=True)
class TimedRequest:
    arrival_s: float
    request: Request
    measured: bool = True


class SkipIdleClock:
    """perf_counter that can jump forward: waiting for an arrival on an idle server costs no real time."""

    def __init__(self):
        self._start = time.perf_counter()
        self._skipped = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self._start + self._skipped

    def advance_to(self, t: float) -> None:
        now = self()
        if t > now:
            self._skipped += t - now


def run_arrivals(engine: PrefillEngine, timed: Sequence[TimedRequest], *, token_budget: int,
                 chunk_size: Optional[int], background: Optional[Request] = None) -> tuple[list[RequestRecord], Optional[RequestRecord]]:
    """Serve `timed` requests (arrival times in seconds) with a StepScheduler; returns their records in order.

    `background`, if given, arrives first and keeps decoding until every timed request is finished; its record
    shows the decode stalls the other requests caused.
    """
    clock = SkipIdleClock()
    scheduler = StepScheduler(engine, token_budget, chunk_size=chunk_size, clock=clock)
    pending = sorted(timed, key=lambda t: t.arrival_s)
    records: dict[int, RequestRecord] = {}
    bg_record = scheduler.submit(background, arrived_at=0.0) if background is not None else None
    next_index = 0
    while next_index < len(pending) or any(not r.finished for r in records.values()):
        while next_index < len(pending) and pending[next_index].arrival_s <= clock():
            item = pending[next_index]
            records[next_index] = scheduler.submit(item.request, arrived_at=item.arrival_s)
            next_index += 1
        busy = any(not r.finished for r in records.values()) or (bg_record is not None and not bg_record.finished)
        if not busy and next_index < len(pending):
            clock.advance_to(pending[next_index].arrival_s)
            continue
        scheduler.step()
    if bg_record is not None and not bg_record.finished:
        scheduler.cancel(background.request_id)
    return [records[i] for i in range(len(pending))], bg_record


def mixed_arrivals(model, *, long_len: int = 4096, short_len: int = 64, n_short: int = 16, load: float = 0.3,
                   chunk_size: int = 256, token_budget: Optional[int] = None, long_after: int = 1,
                   seed: int = 0) -> ArrivalsResult:
    engine = PrefillEngine(model)
    vocab = engine.geometry.vocab_size
    # Calibrate: one short prefill sets the time scale (the first call is a warm-up).
    probe = random_tokens(vocab, short_len, seed + 99)
    engine.first_token(probe).kv.release()
    short_s = statistics.median(_timed(engine.first_token, probe)[0] for _ in range(2))
    rng = random.Random(seed)
    mean_gap = short_s / load
    arrivals, t = [], 0.0
    for _ in range(n_short):
        t += rng.expovariate(1.0 / mean_gap)
        arrivals.append(t)
    # The long prompt lands just after the `long_after`-th short one: most short requests arrive behind it.
    long_arrival = arrivals[min(long_after, n_short) - 1] + 1e-3 if n_short else 0.0
    budget = token_budget or (chunk_size + 2 * short_len + 8)

    def arm(chunk: Optional[int]) -> ArrivalsArm:
        timed = [TimedRequest(a, Request(random_tokens(vocab, short_len, seed * 1000 + i), max_new_tokens=2,
                                         request_id=f"short-{i}")) for i, a in enumerate(arrivals)]
        timed.append(TimedRequest(long_arrival, Request(random_tokens(vocab, long_len, seed * 1000 + 999),
                                                        request_id="long")))
        background = Request(random_tokens(vocab, short_len, seed * 1000 + 998), max_new_tokens=1 << 30,
                             request_id="decoding")
        records, bg = run_arrivals(engine, timed, token_budget=budget, chunk_size=chunk, background=background)
        shorts = [r.ttft for r in records if str(r.request_id).startswith("short")]
        long_ttft = next(r.ttft for r in records if r.request_id == "long")
        return ArrivalsArm(chunk, shorts, long_ttft, bg.max_token_gap if bg is not None else 0.0)

    unchunked = arm(None)
    chunked = arm(chunk_size)
    return ArrivalsResult(long_len, short_len, n_short, short_s, unchunked, chunked)


# ---- command line ----------------------------------------------------------------------------------------------


def _summary(name: str, result) -> dict:
    out = {"workload": name, "ratio": round(result.ratio, 3)}
    if isinstance(result, ArrivalsResult):
        for arm_name in ("unchunked", "chunked"):
            arm = getattr(result, arm_name)
            out[arm_name] = {"short_p50_s": round(arm.short_p50_s, 3), "short_p95_s": round(arm.short_p95_s, 3),
                             "long_ttft_s": round(arm.long_ttft_s, 3), "decode_stall_s": round(arm.decode_stall_s, 3),
                             "chunk_size": arm.chunk_size}
        out["short_prefill_s"] = round(result.short_prefill_s, 3)
    else:
        out.update({k: (round(v, 3) if isinstance(v, float) else [round(x, 3) for x in v] if isinstance(v, list) else v)
                    for k, v in asdict(result).items()})
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-135m", choices=sorted(zoo.PRESETS))
    parser.add_argument("--only", choices=("shared-prefix", "chat", "mixed-arrivals"), action="append")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the whole run")
    parser.add_argument("--long-len", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = zoo.build_preset(args.model)
    chosen = args.only or ["shared-prefix", "chat", "mixed-arrivals"]
    for name in chosen:
        if name == "shared-prefix":
            result = shared_prefix(model, repeats=args.repeats)
        elif name == "chat":
            result = chat(model, repeats=max(1, args.repeats - 1))
        else:
            result = mixed_arrivals(model, long_len=args.long_len)
        print(json.dumps(_summary(name, result)), flush=True)


if __name__ == "__main__":
    main()
