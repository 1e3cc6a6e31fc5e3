"""A step scheduler that interleaves prefill chunks with other requests' decode steps under a token budget, and
batches the prefills of requests that arrive close together.

Each `step()` (the Sarathi-Serve recipe, plus a batching window):
  1. every running request decodes one token (FCFS, one budget token each), all of them in ONE batched forward
     (`engine.decode_batch`: a step reads the weights once, however many requests decode): decodes are never
     starved by a prefill;
  2. the rest of the budget goes to prefills, by priority first (`Request.priority`, lower sooner, aged: see
     below), then shortest remaining prompt first (what minimises mean TTFT), with arrival order breaking ties; a
     prefill that got nothing for `max_skipped_steps` steps in a row goes first among those of its priority, so a
     long prompt is never starved by shorter ones. With chunking, a request gets at most `chunk_size` tokens per
     step, so a long prompt takes many steps and a short prompt that arrives meanwhile waits for one step, not the
     whole prompt; without chunking a prompt is prefilled whole (the first prefill of a step always runs, however long).
     Past the first prefill of a step, a prompt that fits in one chunk runs only if it fits the budget left whole
     (split, it would wait a step more for its first token), while a prompt that is chunked anyway takes what is
     left, Sarathi style, if that is at least `min_chunk` tokens: a sliver of a few tokens would cost a forward of
     its own, and a prefix of 1 token makes a compiled model recompile;
  3. the prefills chosen for the step that the engine can run on its bucketed path (cold prompts, or a cold
     prompt's first chunk, that fit a bucket) run together, in shared padded forwards; the others (prefix-cache
     hits, later chunks) run one after another on the KV path.

New requests first. When an admitted request whose prefill has not started has the best priority in flight, the
step runs its prefills (planned the same way, on the budget the decodes leave) before its decodes: the new
request's first token does not wait for a decode forward. The running streams lose nothing in steady state: the
gap between two of their tokens is a step either way, only the order inside it changes.

The budget is what bounds a step's time, and so the TTFT of a short request that arrives while a long prompt is
being prefilled: it waits for the step under way, then runs in the next one beside the long prompt's chunk. A
smaller budget makes steps shorter (short requests wait less, streams stall less) and a long prompt's own TTFT
longer (more, smaller chunks, each with a forward's overhead and a re-read of the KV so far); ttftc.LLM's
defaults are sized for short requests beside long prompts (measurements: benchmarks/README.md, serving). Attention
makes a chunk late in a long prompt dearer than one early on, so the bound is on tokens, and a step's time grows
with the KV its chunk attends to.

Priorities. Priority outranks everything else, a prompt's chunks under way included: a higher-priority arrival
takes the next step's budget ahead of the remaining chunks of a lower-priority long prompt (and, once admitted,
waiting requests take the free slots in priority order, then arrival order). That alone does not keep a long
prompt's chunk out of the way: a short request that arrives while the chunk runs waits for it, and a chunk late in
a long prompt is the dearest step there is (benchmarks/README.md, serving). So a prefill yields while a request of
better priority is in flight (prefilling or decoding): it shares no step with a better prefill, and runs at most
`yield_chunk` tokens per step (min_chunk by default), which bounds the step a better arrival waits for. Yielding
costs the low-priority prompt throughput (more, smaller forwards), which is what its priority asked for.

Aging bounds starvation without letting a backlog outrank the priority it aged to (`aged_priority` in
runtime/ttft_estimate.py, which the replay shares):
  - a prefill's priority improves by one level per AGE_STEP_S seconds since it arrived or last ran a chunk, up to
    the best priority among the prefills, and reaches that best after MAX_AGE_S whatever the gap: a priority
    2**31 levels behind still gets there (priorities are a privilege over HTTP, serve/policy.py, but not in-process);
  - a prefill that aged to a level goes after the prefills native to it, and yields there (at most `yield_chunk`
    tokens a step), as it did below: aging earns it a place in the step, not the front of it. So a fresh request
    of priority -1 is not queued behind 200 prompts of priority 0 that merely waited a second (they did, when ties
    went to the earlier arrival);
  - and so that a flood at the best level cannot keep aged prefills out for ever, each step reserves `yield_chunk`
    tokens for ONE aged prefill at the top level that got nothing for `max_skipped_steps` steps (the one skipped
    longest), planned first and run last: the native requests' forwards in that step go before it.
So a prefill waits at most min((its priority - the best) * AGE_STEP_S, MAX_AGE_S) seconds plus
(`max_skipped_steps` + 1) steps for each aged prefill ahead of it, per chunk; a prompt that runs, if in small
chunks, is not starving and keeps its priority. A request at the best level is delayed by aged work by at most one
`yield_chunk` forward a step (with chunked prefill; without it, the reserved prompt runs whole, once), which the
TTFT replay counts, and a later arrival of its own or a worse priority never
goes ahead of it, except a shorter one of its own priority (shortest first) for at most `max_skipped_steps` steps.
Equal priorities order as if there were none, however long each waited.

The batching window. A request that has not started its prefill waits until `batch_window_s` has passed since the
earliest such request arrived, or until the waiting prompts hold `token_budget` tokens, whichever comes first;
then all of them (up to `max_running` sequences in flight) are admitted into one step. The window is a trade:
every request it holds back pays up to the whole window in TTFT, and what it buys is fewer, larger prefill
forwards (throughput: one GEMM over B prompts reads the weights once instead of B times). A window of 0 admits
each request at the next step; under load, requests that arrive during a step are batched anyway, so the window
only matters when the engine would otherwise start a prefill for a single request while more are about to come.

Arrivals during a step. `intake`, if set, runs between a step's decodes and the planning of its prefills and may
`submit` requests: one that arrived while the step decoded is planned in this step, where it would otherwise wait
for the step's prefills too (runtime/engine_loop.py submits its inbox there).

Tokens and finishes are reported as they happen, through `on_token(request_id, token)` and
`on_finish(request_id)` if set, not only in the StepStats at the end of the step: a short prompt's first token
must not wait for the rest of the step (a long prompt's chunk, other requests' decodes) to reach its client.

TTFT estimates. The scheduler times every forward it runs into `cost_model` (runtime/ttft_estimate.py) and
publishes `view`, a frozen picture of its queue (each prefill's aged priority and remaining tokens, the running
sequences' remaining decodes, when the step under way should end), at every submit, cancel, plan and step end;
`estimate(...)` replays the next steps from it.

One scheduler belongs to one thread: nothing here is locked (runtime/engine_loop.py drives it from its thread);
`view` and the cost model's fit are replaced whole, so other threads may read them.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence, Union

from ttftc.runtime.chunked import FirstToken, PrefillJob
from ttftc.runtime.engine import PrefillEngine, PromptIds
from ttftc.runtime.sampling import GREEDY, Sampling
from ttftc.runtime.ttft_estimate import (AGE_STEP_S, MAX_AGE_S, CostModel, QueuedDecode, QueuedPrefill, QueueView,
                                         StepShape, aged_priority)

# RequestRecord.finish_reason values.
LENGTH, STOP, CANCELLED, ERROR = "length", "stop", "cancelled", "error"

__all__ = ["AGE_STEP_S", "MAX_AGE_S", "Request", "RequestRecord", "StepScheduler", "StepStats"]


@dataclass
class Request:
    prompt: PromptIds
    max_new_tokens: int = 1
    tenant: Hashable = None
    sampling: Sampling = GREEDY
    eos_token_id: Optional[int] = None
    request_id: Hashable = None
    stop_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs sooner (vLLM's convention); ties and aging: the module docstring

    def __post_init__(self):  # here, not in submit: ttftc.runtime.engine_loop queues requests for another thread
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer (lower runs sooner), got {self.priority!r}")


@dataclass
class RequestRecord:
    """What happened to one request; times come from the scheduler's clock."""

    request_id: Hashable
    prompt_tokens: int
    submitted_at: float
    cached_tokens: int = 0
    prefill_started_at: Optional[float] = None
    first_token_at: Optional[float] = None
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finished: bool = False
    cancelled: bool = False
    finish_reason: Optional[str] = None  # LENGTH, STOP, CANCELLED or ERROR once it is over
    error: Optional[str] = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def queue_time(self) -> Optional[float]:
        """From arrival to the first forward that computed any of its tokens (the batching window included)."""
        return None if self.prefill_started_at is None else self.prefill_started_at - self.submitted_at

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

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
    emitted: tuple = ()  # (request_id, token) in the order the tokens were produced
    batched_rows: int = 0  # prompts whose prefill ran in a shared bucketed forward this step


@dataclass(eq=False)  # identity: two requests with equal fields are still two requests
class _Prefill:
    request: Request
    record: RequestRecord
    job: PrefillJob
    arrival_order: int
    waiting_since: float  # arrival, then the end of the last step that ran a chunk of it: what aging counts from
    skipped_steps: int = 0

    @property
    def started(self) -> bool:
        return self.record.prefill_started_at is not None


@dataclass(eq=False)
class _Running:
    request: Request
    record: RequestRecord
    first: FirstToken
    generator: object


class StepScheduler:
    def __init__(self, engine: PrefillEngine, token_budget: int, *, chunk_size: Optional[int] = None,
                 clock: Callable[[], float] = time.perf_counter, max_skipped_steps: int = 4,
                 batch_window_s: float = 0.0, max_running: Optional[int] = None, min_chunk: int = 32,
                 cost_model: Optional[CostModel] = None, yield_chunk: Optional[int] = None):
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
        if not batch_window_s >= 0.0 or math.isinf(batch_window_s):
            raise ValueError(f"batch_window_s must be a finite number >= 0, got {batch_window_s}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running must be >= 1 or None, got {max_running}")
        if min_chunk < 1:
            raise ValueError(f"min_chunk must be >= 1, got {min_chunk}")
        if yield_chunk is not None and yield_chunk < 1:
            raise ValueError(f"yield_chunk must be >= 1 or None (min_chunk), got {yield_chunk}")
        self.engine = engine
        self.token_budget = token_budget
        self.chunk_size = chunk_size
        self.clock = clock
        self.max_skipped_steps = max_skipped_steps
        self.batch_window_s = batch_window_s
        self.max_running = max_running
        self.min_chunk = min_chunk
        self.yield_chunk = min_chunk if yield_chunk is None else yield_chunk
        self.records: dict[Hashable, RequestRecord] = {}
        # Called during step(), on the scheduler's thread (see the module docstring).
        self.on_token: Optional[Callable[[Hashable, int], None]] = None
        self.on_finish: Optional[Callable[[Hashable], None]] = None
        # Called between a step's decodes and the planning of its prefills, to `submit` what arrived meanwhile.
        self.intake: Optional[Callable[[], None]] = None
        self._prefilling: list[_Prefill] = []
        self._running: deque[_Running] = deque()
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self.view = QueueView()
        self._forwards_s = 0.0  # this step's forwards, timed; the rest of the step is overhead (ttft_estimate)

    # ---- state -----------------------------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self._prefilling and not self._running

    @property
    def num_running(self) -> int:
        """Sequences holding a slot: decoding, or with their prefill under way."""
        return len(self._running) + sum(1 for item in self._prefilling if item.started)

    @property
    def num_waiting(self) -> int:
        """Requests whose prefill has not started (inside the batching window, or without a free slot)."""
        return sum(1 for item in self._prefilling if not item.started)

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV the requests in flight hold right now."""
        return sum(run.first.kv.seq_len for run in self._running) + sum(
            item.job.position for item in self._prefilling if not item.job.cancelled)

    def next_step_at(self) -> Optional[float]:
        """When a `step()` would next do work (scheduler clock): now while anything runs, the end of the batching
        window while requests only wait in it, None when there is nothing at all."""
        if self._running or any(item.started for item in self._prefilling):
            return self.clock()
        waiting = [item for item in self._prefilling if not item.started]
        if not waiting:
            return None
        if sum(item.job.remaining for item in waiting) >= self.token_budget:
            return self.clock()
        return min(item.record.submitted_at for item in waiting) + self.batch_window_s

    # ---- requests in and out ---------------------------------------------------------------------------------------

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
        self._prefilling.append(_Prefill(request, record, job, next(self._arrivals), waiting_since=now))
        self._publish_view()
        return record

    def cancel(self, request_id: Hashable) -> RequestRecord:
        """Stop a queued or running request and free its KV and its slot."""
        for item in list(self._prefilling):
            if item.request.request_id == request_id:
                self._prefilling.remove(item)
                item.job.cancel()
                self._close(item.record, CANCELLED)
                self._publish_view()
                return item.record
        for run in list(self._running):
            if run.request.request_id == request_id:
                self._running.remove(run)
                self._finish(run.first, run.record, CANCELLED)
                self._publish_view()
                return run.record
        raise KeyError(f"no queued or running request {request_id!r}")

    def forget(self, request_id: Hashable) -> RequestRecord:
        """Drop the record of a finished request (a long-running server would otherwise keep every one)."""
        record = self.records[request_id]
        if not record.done:
            raise ValueError(f"request {request_id!r} is still in flight; cancel it first")
        return self.records.pop(request_id)

    # ---- one step --------------------------------------------------------------------------------------------------

    def step(self) -> StepStats:
        finished: list = []
        emitted: list = []
        step_started, self._forwards_s = self.clock(), 0.0
        aged = self._aged_priorities()
        admitted = self._admissible(aged)
        best = self._best_in_flight(aged)
        rows = min(len(self._running), self.token_budget)  # the sequences this step decodes
        if rows and any(not item.started and aged[id(item)] <= best for item in admitted):
            # A new request of the best priority: its prefill goes before this step's decodes (module docstring).
            plan = self._plan_prefills(admitted, self.token_budget - rows, aged, best)
            batched_rows = self._run_plan(plan, aged, finished, emitted, then_s=self.cost_model.decode_s(rows))
            decode_tokens = self._decode(rows, finished, emitted)
        else:
            if rows:
                self._publish_view(ends_at=self.clock() + self.cost_model.decode_s(rows),
                                   joins_step=self.intake is not None)
            decode_tokens = self._decode(self.token_budget, finished, emitted)
            if self.intake is not None:
                self.intake()
            aged = self._aged_priorities()
            admitted = self._admissible(aged)
            plan = self._plan_prefills(admitted, self.token_budget - decode_tokens, aged, self._best_in_flight(aged))
            batched_rows = self._run_plan(plan, aged, finished, emitted)
        served = {id(item) for item, _ in plan}
        step_ended = self.clock()
        for item in admitted:  # only a prefill that could have run and got no budget is being skipped
            item.skipped_steps = 0 if id(item) in served else item.skipped_steps + 1
            if id(item) in served:
                item.waiting_since = step_ended
        self._publish_view()
        if decode_tokens or plan:
            self.cost_model.observe_step(self.clock() - step_started, self._forwards_s)
        return StepStats(decode_tokens, sum(n for _, n in plan), tuple(finished), tuple(emitted), batched_rows)

    def _best_in_flight(self, aged: dict[int, int]) -> int:
        """The best priority among the prefills (aged) and the running sequences (their own)."""
        return min([*aged.values(), *(run.request.priority for run in self._running)], default=0)

    def _run_plan(self, plan: list[tuple[_Prefill, int]], aged: dict[int, int], finished: list, emitted: list,
                  then_s: float = 0.0) -> int:
        """Publish the step's plan (its end: the planned forwards' predicted cost plus `then_s`) and run it."""
        if plan:
            cost = sum(self.cost_model.prefill_s(n, item.job.position) for item, n in plan)
            self._publish_view(plan, ends_at=self.clock() + cost + then_s, aged=aged)
        return self._prefill(plan, finished, emitted)

    # ---- the TTFT estimate -----------------------------------------------------------------------------------------

    def _observe(self, observe, rows, started: float) -> None:
        seconds = self.clock() - started
        self._forwards_s += seconds
        observe(rows, seconds)

    @property
    def shape(self) -> StepShape:
        return StepShape(self.token_budget, self.chunk_size, self.min_chunk, self.batch_window_s, self.yield_chunk,
                         self.max_skipped_steps)

    def _publish_view(self, plan: Sequence[tuple[_Prefill, int]] = (), *, ends_at: Optional[float] = None,
                      aged: Optional[dict[int, int]] = None, joins_step: bool = False) -> None:
        """Replace `view`; a step's planned chunks count as done already (their time is in `ends_at`)."""
        aged = self._aged_priorities() if aged is None else aged
        planned = {id(item): n for item, n in plan}
        prefills = []
        decoding = [QueuedDecode(run.request.priority, run.request.max_new_tokens - len(run.record.tokens))
                    for run in self._running]
        for item in self._prefilling:
            n = planned.get(id(item), 0)
            after = item.request.max_new_tokens - 1
            if item.job.remaining - n <= 0:
                decoding.append(QueuedDecode(item.request.priority, after))
            else:
                ran = n > 0
                prefills.append(QueuedPrefill(aged.get(id(item), item.request.priority), item.job.remaining - n,
                                              item.job.position + n, item.arrival_order, after,
                                              started=item.started or ran, native=item.request.priority,
                                              waiting_since=ends_at if ran and ends_at is not None
                                              else item.waiting_since,
                                              skipped=0 if ran else item.skipped_steps))
        self.view = QueueView(tuple(prefills), tuple(d for d in decoding if d.tokens > 0), ends_at, joins_step)

    def _decode(self, budget: int, finished: list, emitted: list) -> int:
        """One token for each of the first `budget` running requests, in one batched forward; those that decoded go
        behind those that did not (FCFS rotation when the budget is short)."""
        batch = list(itertools.islice(self._running, max(0, min(len(self._running), budget))))
        if not batch:
            return 0
        rows = [(run.first.kv, run.record.tokens[-1], run.request.sampling, run.generator) for run in batch]
        started = self.clock()
        try:
            results = self.engine.decode_batch(rows)
        except Exception as exc:  # the engine isolates rows; this is a bug in it: fail the batch, not the step
            results = [exc] * len(batch)
        else:
            self._observe(self.cost_model.observe_decode, len(rows), started)
        count = 0
        for run, result in zip(batch, results):
            if not any(run is live for live in self._running):
                continue  # cancelled by a callback of an earlier row of this batch: its KV is gone already
            self._running.remove(run)
            if isinstance(result, BaseException):
                self._finish(run.first, run.record, ERROR, error=result)
                self._report_finish(run.request, finished)
                continue
            count += 1
            self._running.append(run)  # before the callback: a cancel from inside it finds the request
            self._emit(run.request, run.record, result, emitted)
            if not any(run is live for live in self._running):
                continue  # its own callback cancelled it
            reason = self._finish_reason(run.request, run.record)
            if reason is not None:
                self._running.remove(run)
                self._finish(run.first, run.record, reason)
                self._report_finish(run.request, finished)
        return count

    def _aged_priorities(self) -> dict[int, int]:
        """Each prefill's priority this step (by id): `aged_priority` of its own, counted from its arrival or last
        chunk, toward the best priority among the prefills (the module docstring says why)."""
        priorities = {id(item): item.request.priority for item in self._prefilling}
        best = min(priorities.values(), default=0)
        if all(p == best for p in priorities.values()):
            return priorities  # nothing to catch up with (and no clock read: steps stay as they were)
        now = self.clock()
        for item in self._prefilling:
            priorities[id(item)] = aged_priority(item.request.priority, now - item.waiting_since, best)
        return priorities

    def _admissible(self, aged: dict[int, int]) -> list[_Prefill]:
        """Prefills this step may serve: those under way, plus waiting ones once their window closed and slots
        are free."""
        started = [item for item in self._prefilling if item.started]
        waiting = [item for item in self._prefilling if not item.started]
        if not waiting:
            return started
        now = self.clock()
        window_closed = (now >= min(item.record.submitted_at for item in waiting) + self.batch_window_s
                         or sum(item.job.remaining for item in waiting) >= self.token_budget)
        if not window_closed:
            return started
        slots = len(waiting) if self.max_running is None else max(0, self.max_running - self.num_running)
        # Native before aged at a level (module docstring): a backlog that aged takes no slot ahead of a fresh request.
        waiting.sort(key=lambda item: (aged[id(item)], aged[id(item)] < item.request.priority, item.arrival_order))
        return started + waiting[:slots]

    def _plan_prefills(self, admitted: list[_Prefill], budget: int, aged: dict[int, int],
                       best: int) -> list[tuple[_Prefill, int]]:
        """This step's prefills and their tokens; `best` is the best priority in flight (prefills and decodes)."""
        plan: list[tuple[_Prefill, int]] = []
        order = sorted(admitted, key=lambda item: self._prefill_order(item, aged))
        reserved = self._reserved(order, aged)
        if reserved is not None:  # planned first, so that it always gets its tokens; run last (module docstring)
            order.remove(reserved)
            order.insert(0, reserved)
        for item in order:
            if budget <= 0:
                break
            if plan and aged[id(item)] > aged[id(plan[0][0])]:
                break  # a worse prefill shares no step with a better one (and all behind it are as bad)
            job = item.job
            want = job.remaining if self.chunk_size is None else min(self.chunk_size, job.remaining)
            if self.chunk_size is not None and (aged[id(item)] > best or aged[id(item)] < item.request.priority):
                want = min(want, self.yield_chunk)  # it yields: short steps for the better requests in flight
            if not plan:
                n = want if self.chunk_size is None else min(want, budget)  # the first prefill always runs
            elif want <= budget:
                n = want
            elif self.chunk_size is not None and job.remaining > self.chunk_size and budget >= self.min_chunk:
                n = budget  # a chunked prompt takes what is left (Sarathi); a short one waits to run whole
            else:
                continue  # a sliver of the budget would cost a whole forward for a few tokens; the next step has room
            plan.append((item, n))
            budget -= n
        if reserved is not None and plan and plan[0][0] is reserved:
            plan.append(plan.pop(0))
        return plan

    def _reserved(self, order: list[_Prefill], aged: dict[int, int]) -> Optional[_Prefill]:
        """The aged prefill whose tokens this step reserves: at the top level, starving, skipped longest."""
        if not order:
            return None
        top = aged[id(order[0])]
        starving = [item for item in order if aged[id(item)] == top and top < item.request.priority
                    and item.skipped_steps >= self.max_skipped_steps]
        return max(starving, key=lambda item: (item.skipped_steps, -item.arrival_order), default=None)

    def _prefill(self, plan: list[tuple[_Prefill, int]], finished: list, emitted: list) -> int:
        """Run the planned prefills in priority order; the bucketed ones together, where the first of them stands."""
        together = [(item, n) for item, n in plan if self.engine.bucket_for(item.job, n) is not None]
        ran_together = False
        for item, n in plan:
            if any(item is other for other, _ in together):
                if ran_together:
                    continue
                ran_together = True
                self._mark_started(item for item, _ in together)
                started = self.clock()
                try:
                    results = self.engine.prefill_together([(it.job, k) for it, k in together], publish=False)
                except Exception as exc:
                    results = self._rows_after_failure(together, exc)
                else:
                    self._observe(self.cost_model.observe_prefill, [(k, 0) for _, k in together], started)
                for (it, _), first in zip(together, results):
                    if isinstance(first, Exception):
                        self._fail_prefill(it, first, finished)
                    else:
                        self._after_prefill(it, first, finished, emitted)
                continue
            self._mark_started([item])
            context, started = item.job.position, self.clock()
            try:
                first = item.job.advance(n, publish=False)
            except Exception as exc:
                self._fail_prefill(item, exc, finished)
                continue
            self._observe(self.cost_model.observe_prefill, [(n, context)], started)
            self._after_prefill(item, first, finished, emitted)
        return len(together) if len(together) > 1 else 0

    def _rows_after_failure(self, together: list[tuple[_Prefill, int]],
                            exc: Exception) -> list[Union[FirstToken, None, Exception]]:
        """Each job's own outcome once a shared prefill raised, so that only the request at fault fails (a bad
        seed, say): a job the shared forwards served keeps what it got, a job that took the KV of its whole prompt
        but has no first token failed picking it (the one step of `absorb` after the KV) and gets the error, and a
        job they never reached (or whose forward failed) runs alone, which tells whose fault it was."""
        if len(together) == 1:
            return [exc]
        results: list[Union[FirstToken, None, Exception]] = []
        for item, n in together:
            job = item.job
            if job.cold:
                try:
                    results.append(self.engine.prefill_together([(job, n)], publish=False)[0])
                except Exception as alone:
                    results.append(alone)
            elif job.result is None and job.remaining == 0:
                results.append(exc)
            else:
                results.append(job.result)  # None: the first chunk of a longer prompt, which goes on next step
        return results

    def _mark_started(self, items) -> None:
        now = self.clock()
        for item in items:
            if item.record.prefill_started_at is None:
                item.record.prefill_started_at = now

    def _after_prefill(self, item: _Prefill, first: Optional[FirstToken], finished: list, emitted: list) -> None:
        if first is None:
            return
        self._prefilling.remove(item)
        item.record.first_token_at = self.clock()
        self._emit(item.request, item.record, first.token, emitted, at=item.record.first_token_at)
        try:
            item.job.publish()  # after the first token left, before the first decode grows the KV
        except Exception as exc:
            self._finish(first, item.record, ERROR, error=exc)
            self._report_finish(item.request, finished)
            return
        reason = self._finish_reason(item.request, item.record)
        if reason is not None:
            self._finish(first, item.record, reason)
            self._report_finish(item.request, finished)
        else:
            self._running.append(_Running(item.request, item.record, first, item.request.sampling.generator()))

    def _fail_prefill(self, item: _Prefill, exc: Exception, finished: list) -> None:
        if item in self._prefilling:
            self._prefilling.remove(item)
        item.job.cancel()
        self._close(item.record, ERROR, error=exc)
        self._report_finish(item.request, finished)

    def _emit(self, request: Request, record: RequestRecord, token: int, emitted: list,
              at: Optional[float] = None) -> None:
        record.tokens.append(token)
        record.token_times.append(self.clock() if at is None else at)
        emitted.append((request.request_id, token))
        if self.on_token is not None:
            self.on_token(request.request_id, token)

    def _report_finish(self, request: Request, finished: list) -> None:
        finished.append(request.request_id)
        if self.on_finish is not None:
            self.on_finish(request.request_id)

    def _prefill_order(self, item: _Prefill, aged: dict[int, int]) -> tuple:
        starving = item.skipped_steps >= self.max_skipped_steps
        return (aged[id(item)], aged[id(item)] < item.request.priority, not starving, item.job.remaining,
                item.arrival_order)

    def run_until_idle(self) -> dict[Hashable, RequestRecord]:
        while not self.idle:
            self.step()
        return self.records

    @staticmethod
    def _finish_reason(request: Request, record: RequestRecord) -> Optional[str]:
        last = record.tokens[-1]
        if last == request.eos_token_id or last in request.stop_token_ids:
            return STOP
        if len(record.tokens) >= request.max_new_tokens:
            return LENGTH
        return None

    def _finish(self, first: FirstToken, record: RequestRecord, reason: str, error: Optional[Exception] = None) -> None:
        first.kv.release()
        self._close(record, reason, error)

    @staticmethod
    def _close(record: RequestRecord, reason: str, error: Optional[Exception] = None) -> None:
        record.finish_reason = reason
        record.finished = reason != CANCELLED  # over without being cancelled (an ERROR, too: it will not go on)
        record.cancelled = reason == CANCELLED
        if error is not None:
            record.error = f"{type(error).__name__}: {error}"
