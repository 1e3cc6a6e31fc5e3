"""A step scheduler that interleaves prefill chunks with other requests' decode steps under a token budget.

Each `step()` (the Sarathi-Serve recipe):
  1. every running request decodes one token (FCFS, one budget token each): decodes are never starved by a prefill;
  2. the rest of the budget goes to prefills, shortest remaining prompt first (what minimises mean TTFT), with
     arrival order breaking ties; a prefill that got nothing for `max_skipped_steps` steps in a row goes first,
     so a long prompt is never starved. With chunking, a request gets at most `chunk_size` tokens per step, so a
     long prompt takes many steps and a short prompt that arrives meanwhile waits for one step, not the whole
     prompt; without chunking a prompt is prefilled whole (the first prefill of a step always runs, however long).

There is no batching across requests: each chunk and each decode is its own batch-1 forward, run one after another.
What the scheduler bounds is the work between two consecutive steps, and so how long a decode or a newly arrived
short prompt waits behind a long prefill.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

from ttftc.runtime.chunked import FirstToken, PrefillJob
from ttftc.runtime.engine import PrefillEngine, PromptIds
from ttftc.runtime.sampling import GREEDY, Sampling


@dataclass
class Request:
    prompt: PromptIds
    max_new_tokens: int = 1
    tenant: Hashable = None
    sampling: Sampling = GREEDY
    eos_token_id: Optional[int] = None
    request_id: Hashable = None


@dataclass
class RequestRecord:
    """What happened to one request; times come from the scheduler's clock."""

    request_id: Hashable
    prompt_tokens: int
    submitted_at: float
    cached_tokens: int = 0
    first_token_at: Optional[float] = None
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finished: bool = False
    cancelled: bool = False

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def max_token_gap(self) -> float:
        """The longest wait between two consecutive tokens of this request (its worst decode stall)."""
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return max(gaps, default=0.0)


@dataclass(frozen=True)
class StepStats:
    decode_tokens: int
    prefill_tokens: int
    finished: tuple


@dataclass
class _Prefill:
    request: Request
    record: RequestRecord
    job: PrefillJob
    arrival_order: int
    skipped_steps: int = 0


@dataclass
class _Running:
    request: Request
    record: RequestRecord
    first: FirstToken
    generator: object


class StepScheduler:
    def __init__(self, engine: PrefillEngine, token_budget: int, *, chunk_size: Optional[int] = None,
                 clock: Callable[[], float] = time.perf_counter, max_skipped_steps: int = 4):
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
        self.engine = engine
        self.token_budget = token_budget
        self.chunk_size = chunk_size
        self.clock = clock
        self.max_skipped_steps = max_skipped_steps
        self.records: dict[Hashable, RequestRecord] = {}
        self._prefilling: list[_Prefill] = []
        self._running: deque[_Running] = deque()
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    @property
    def idle(self) -> bool:
        return not self._prefilling and not self._running

    def submit(self, request: Request, *, arrived_at: Optional[float] = None) -> RequestRecord:
        """Queue a request (its prompt is validated and looked up in the prefix cache now).

        `arrived_at` (scheduler clock) is when the request really arrived, if earlier than now: a request that
        arrives during a step is only admitted after it, and its TTFT must still count from its arrival.
        """
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if request.request_id is None:
            request.request_id = next(self._ids)
        if request.request_id in self.records:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        now = self.clock() if arrived_at is None else arrived_at
        job = self.engine.start(request.prompt, tenant=request.tenant, sampling=request.sampling)
        record = RequestRecord(request.request_id, len(job.token_ids), now, cached_tokens=job.cached_tokens)
        self.records[request.request_id] = record
        self._prefilling.append(_Prefill(request, record, job, next(self._arrivals)))
        return record

    def cancel(self, request_id: Hashable) -> None:
        for item in list(self._prefilling):
            if item.request.request_id == request_id:
                self._prefilling.remove(item)
                item.job.cancel()
                item.record.cancelled = True
                return
        for run in list(self._running):
            if run.request.request_id == request_id:
                self._running.remove(run)
                self._finish(run.first, run.record, cancelled=True)
                return
        raise KeyError(f"no queued or running request {request_id!r}")

    def step(self) -> StepStats:
        budget = self.token_budget
        finished = []
        decode_tokens = 0
        for _ in range(min(len(self._running), budget)):
            run = self._running.popleft()
            token, _ = self.engine.decode_step(run.first.kv, run.record.tokens[-1], run.request.sampling,
                                               run.generator)
            run.record.tokens.append(token)
            run.record.token_times.append(self.clock())
            decode_tokens += 1
            if self._complete(run.request, run.record):
                self._finish(run.first, run.record)
                finished.append(run.request.request_id)
            else:
                self._running.append(run)
        budget -= decode_tokens

        prefill_tokens = 0
        served = set()
        for item in sorted(self._prefilling, key=self._prefill_priority):
            if budget <= 0:
                break
            job = item.job
            if self.chunk_size is None:
                if prefill_tokens and job.remaining > budget:
                    continue
                n = job.remaining
            else:
                n = min(self.chunk_size, budget, job.remaining)
            first = job.advance(n)
            served.add(id(item))
            prefill_tokens += n
            budget -= n
            if first is None:
                continue
            self._prefilling.remove(item)
            now = self.clock()
            item.record.first_token_at = now
            item.record.tokens.append(first.token)
            item.record.token_times.append(now)
            if self._complete(item.request, item.record):
                self._finish(first, item.record)
                finished.append(item.request.request_id)
            else:
                self._running.append(_Running(item.request, item.record, first, item.request.sampling.generator()))
        for item in self._prefilling:
            item.skipped_steps = 0 if id(item) in served else item.skipped_steps + 1
        return StepStats(decode_tokens, prefill_tokens, tuple(finished))

    def _prefill_priority(self, item: _Prefill) -> tuple:
        starving = item.skipped_steps >= self.max_skipped_steps
        return (not starving, item.job.remaining, item.arrival_order)

    def run_until_idle(self) -> dict[Hashable, RequestRecord]:
        while not self.idle:
            self.step()
        return self.records

    @staticmethod
    def _complete(request: Request, record: RequestRecord) -> bool:
        return len(record.tokens) >= request.max_new_tokens or (
            request.eos_token_id is not None and record.tokens[-1] == request.eos_token_id)

    @staticmethod
    def _finish(first: FirstToken, record: RequestRecord, cancelled: bool = False) -> None:
        first.kv.release()
        record.finished = not cancelled
        record.cancelled = cancelled
