"""The step scheduler's decisions, against a scripted engine (no model): budgets, priorities, the batching window,
slots, cancels, failures, callbacks and records, each checked step by step.

tests/runtime/test_sessions_and_scheduler.py runs the scheduler with real models (tokens equal serial decoding);
here the engine only records what it was asked to do, so every test is exact and takes milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest

from ttftc.runtime.sampling import GREEDY, Sampling
from ttftc.runtime.scheduler import (AGE_STEP_S, CANCELLED, ERROR, LENGTH, STOP, Request, RequestRecord,
                                     StepScheduler)


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class TickingClock(Clock):
    """A clock that moves on every read, as a real one does: a time read twice differs."""

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class FakeKV:
    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.released = False

    def release(self) -> None:
        assert not self.released, "KV released twice"
        self.released = True


@dataclass
class FakeFirst:
    token: int
    kv: FakeKV


class FakeJob:
    """A prefill job: `advance` moves `position`; the first token is the prompt's last id + 1."""

    def __init__(self, engine: "FakeEngine", ids: list[int], tenant, cached: int):
        self.engine, self.token_ids, self.tenant = engine, list(ids), tenant
        self.position = self.cached_tokens = cached
        self.cancelled = False
        self.result: Optional[FakeFirst] = None
        self.published = False

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.position

    @property
    def cold(self) -> bool:
        return self.position == 0 and not self.cancelled and self.result is None

    def advance(self, n, *, publish=True):
        assert not self.cancelled and n >= 1 and not publish
        self.engine.calls.append(("advance", self.token_ids[0], n))
        if self.token_ids[0] in self.engine.fail_prefill:
            raise RuntimeError("injected prefill failure")
        return self._take(n)

    def _take(self, n):
        self.position += n
        assert self.position <= len(self.token_ids)
        if self.remaining == 0:
            self.result = FakeFirst(self.token_ids[-1] + 1, FakeKV(len(self.token_ids)))
        return self.result

    def publish(self):
        self.engine.calls.append(("publish", self.token_ids[0]))
        if self.token_ids[0] in self.engine.fail_publish:
            raise RuntimeError("injected publish failure")
        self.published = True

    def cancel(self):
        self.cancelled = True
        self.engine.cancelled.append(self.token_ids[0])


class FakeEngine:
    """What StepScheduler calls on a PrefillEngine. Prompts are told apart by their first token id."""

    def __init__(self, buckets: tuple[int, ...] = (), cached: Optional[dict] = None):
        self.buckets = buckets
        self.cached = cached or {}  # first token id -> tokens served from the prefix cache
        self.calls: list[tuple] = []
        self.cancelled: list[int] = []
        self.fail_prefill: set[int] = set()
        self.fail_together = False
        self.fail_decode: set[int] = set()
        self.fail_publish: set[int] = set()
        self.fail_batch = False
        self.started_with: list[tuple] = []  # (first token id, sampling) of every job started
        self.decoded: list[tuple] = []  # (token fed, generator passed) of every decode step

    def start(self, prompt, *, tenant=None, sampling=None):
        self.started_with.append((prompt[0], sampling))
        return FakeJob(self, prompt, tenant, self.cached.get(prompt[0], 0))

    def bucket_for(self, job, n):
        if not self.buckets or not job.cold or n < 1:
            return None
        return next((b for b in self.buckets if b >= n), None)

    def prefill_together(self, work, *, publish=True):
        assert not publish
        self.calls.append(("together", tuple((job.token_ids[0], n) for job, n in work)))
        if self.fail_together:
            raise RuntimeError("injected batch failure")
        return [job._take(n) for job, n in work]

    def decode_batch(self, rows):
        self.calls.append(("batch", tuple(token for _, token, _, _ in rows)))
        if self.fail_batch:
            raise RuntimeError("injected engine bug")
        results = []
        for kv, token, sampling, generator in rows:
            try:
                results.append(self.decode_step(kv, token, sampling, generator)[0])
            except Exception as exc:  # the real engine isolates a row's failure the same way
                results.append(exc)
        return results

    def decode_step(self, kv, token, sampling, generator):
        self.calls.append(("decode", token))
        self.decoded.append((token, generator))
        if token in self.fail_decode:
            raise RuntimeError("injected decode failure")
        kv.seq_len += 1
        return token + 1, None


def prompt(first: int, length: int) -> list[int]:
    """A prompt of `length` tokens whose first id names it."""
    return [first] + [7] * (length - 1)


def scheduler(engine=None, budget=64, **kwargs) -> StepScheduler:
    kwargs.setdefault("clock", Clock())
    return StepScheduler(engine or FakeEngine(), budget, **kwargs)


def prefills(engine) -> list[tuple]:
    """(first id, tokens) of every prefill forward so far, in order; a batched forward is one tuple of them."""
    return [c[1:] if c[0] == "advance" else c[1] for c in engine.calls if c[0] in ("advance", "together")]


# ---- construction and submission ------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=0), "token_budget must be >= 1"),
    (dict(chunk_size=0), "chunk_size must be >= 1 or None"),
    (dict(batch_window_s=-0.001), "batch_window_s must be a finite number >= 0"),
    (dict(batch_window_s=math.inf), "batch_window_s must be a finite number >= 0"),
    (dict(batch_window_s=math.nan), "batch_window_s must be a finite number >= 0"),
    (dict(max_running=0), "max_running must be >= 1 or None"),
    (dict(yield_chunk=0), "yield_chunk must be >= 1 or None"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        scheduler(**kwargs)


def test_the_smallest_valid_settings_are_accepted():
    s = scheduler(budget=1, chunk_size=1, batch_window_s=0.0, max_running=1)
    s.submit(Request(prompt(1, 2)))
    s.run_until_idle()
    assert s.records[0].finish_reason == LENGTH


def test_submit_numbers_requests_refuses_duplicates_and_records_the_arrival():
    clock = Clock(5.0)
    engine = FakeEngine(cached={3: 2})
    s = scheduler(engine, clock=clock)
    first, second = s.submit(Request(prompt(1, 4))), s.submit(Request(prompt(2, 5)))
    assert (first.request_id, second.request_id) == (0, 1) and first.submitted_at == 5.0
    early = s.submit(Request(prompt(3, 6), request_id="x"), arrived_at=4.5)
    assert early.submitted_at == 4.5 and early.prompt_tokens == 6 and early.cached_tokens == 2
    assert early.computed_tokens == 4
    with pytest.raises(ValueError, match="duplicate request id 'x'"):
        s.submit(Request(prompt(4, 2), request_id="x"))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        s.submit(Request(prompt(5, 2), max_new_tokens=0))
    assert set(s.records) == {0, 1, "x"} and s.num_waiting == 3 and s.num_running == 0


# ---- budget, chunks and priority ----------------------------------------------------------------------------


def test_each_step_spends_at_most_its_budget_in_chunks():
    engine = FakeEngine()
    s = scheduler(engine, budget=10, chunk_size=4)
    s.submit(Request(prompt(1, 9), max_new_tokens=3))
    stats = [s.step() for _ in range(3)]
    # 9 tokens in chunks of 4, one chunk of a request per step, whatever budget is left: 4, 4, 1.
    assert [(st.decode_tokens, st.prefill_tokens) for st in stats] == [(0, 4), (0, 4), (0, 1)]
    assert prefills(engine) == [(1, 4), (1, 4), (1, 1)]
    assert stats[2].emitted == ((0, 8),) and s.records[0].first_token_at == 0.0
    assert s.step().decode_tokens == 1 and s.step().finished == (0,)
    assert s.records[0].tokens == [8, 9, 10] and s.idle


def test_without_chunks_the_first_prefill_runs_whole_and_later_ones_only_if_they_fit():
    engine = FakeEngine()
    s = scheduler(engine, budget=8)
    for first, length in ((1, 20), (2, 5), (3, 4), (4, 3)):
        s.submit(Request(prompt(first, length)))
    stats = s.step()
    # Shortest first: 3 (budget 8 -> 5), then 4 (5 -> 1 left); 5 and 20 do not fit the rest.
    assert prefills(engine) == [(4, 3), (3, 4)] and stats.prefill_tokens == 7
    s.step()
    assert prefills(engine)[2:] == [(2, 5)]  # 20 > 3 tokens left after it: it waits
    s.step()
    assert prefills(engine)[3:] == [(1, 20)] and s.step().prefill_tokens == 0  # alone, it runs whole


def test_the_first_prefill_takes_what_the_decodes_left_and_a_later_one_must_fit_whole():
    engine = FakeEngine()
    s = scheduler(engine, budget=10, chunk_size=8)
    for first in (10, 20, 30, 40):
        s.submit(Request([first], max_new_tokens=50))
    assert s.step().prefill_tokens == 4  # four 1-token prompts: all four start decoding
    s.submit(Request(prompt(1, 30)))
    s.submit(Request(prompt(2, 30)))
    stats = s.step()
    # The 4 decodes leave 6 tokens: prompt 1 (first to arrive) gets 6 of its 8-token chunk, prompt 2 nothing.
    assert (stats.decode_tokens, stats.prefill_tokens) == (4, 6)
    assert prefills(engine)[-1] == (1, 6)
    assert s.step().prefill_tokens == 6 and prefills(engine)[-1] == (1, 6)  # 24 left is shorter than 30


def test_shortest_remaining_first_and_arrival_order_breaks_ties():
    engine = FakeEngine()
    s = scheduler(engine, budget=12, chunk_size=12)
    s.submit(Request(prompt(1, 6)))
    s.submit(Request(prompt(2, 4)))
    s.submit(Request(prompt(3, 6)))
    s.submit(Request(prompt(4, 4)))
    s.step()
    assert prefills(engine) == [(2, 4), (4, 4)]  # 4 + 4, then a 6 no longer fits the 4 left
    s.step()
    assert prefills(engine)[2:] == [(1, 6), (3, 6)]


def _long_prompt_served(engine, s, steps, clock: Optional[Clock] = None, step_s: float = 0.0) -> list[bool]:
    """Per step, whether prompt 1 got a chunk, while a short prompt arrives every step (served first, then the
    long prompt's chunk of 8 does not fit the 4 left); `clock` moves on by `step_s` before each step."""
    served = []
    for step in range(steps):
        s.submit(Request(prompt(100 + step, 6)))
        before = len(engine.calls)
        if clock is not None:
            clock.now += step_s
        s.step()
        served.append(any(c[:2] == ("advance", 1) for c in engine.calls[before:]))
    return served


def test_a_prefill_skipped_for_max_skipped_steps_in_a_row_goes_first():
    engine = FakeEngine()
    s = scheduler(engine, budget=10, chunk_size=8, max_skipped_steps=2)
    s.submit(Request(prompt(1, 40)))
    served = _long_prompt_served(engine, s, 8)
    # Skipped twice, then it goes first (and the short prompt of that step waits); the counter starts over.
    assert served == [False, False, True, False, False, True, False, False]


def test_by_default_a_prefill_goes_first_after_4_skips_and_a_leftover_of_32_tokens_is_taken():
    engine = FakeEngine()
    s = scheduler(engine, budget=10, chunk_size=8)
    s.submit(Request(prompt(1, 80)))
    assert _long_prompt_served(engine, s, 10) == [False] * 4 + [True] + [False] * 4 + [True]
    for left, planned in ((32, [(2, 68), (1, 32)]), (31, [(2, 69)])):
        engine = FakeEngine()
        s = scheduler(engine, budget=100, chunk_size=100)
        s.submit(Request(prompt(1, 400)))
        s.submit(Request(prompt(2, 100 - left)))
        s.step()
        assert prefills(engine) == planned


def test_a_prefill_that_could_not_be_admitted_is_not_counted_as_skipped():
    engine = FakeEngine()
    s = scheduler(engine, budget=10, chunk_size=8, max_skipped_steps=1, max_running=1)
    s.submit(Request(prompt(1, 8), max_new_tokens=4))
    s.submit(Request(prompt(2, 8)))
    for _ in range(3):
        s.step()  # 1 prefills, then decodes twice; 2 has no slot all that time
    waiting = next(item for item in s._prefilling if item.request.request_id == 1)
    assert waiting.skipped_steps == 0 and not waiting.started


def test_prefills_go_by_priority_then_shortest_first_and_slots_by_priority_then_arrival():
    # (first id, priority, length): one prefill per step, as two never fit the budget of 10 together.
    requests = ((1, 2, 6), (2, 0, 9), (3, 1, 7), (4, 0, 8), (5, 1, 6))
    for max_running, expected in ((None, [4, 2, 5, 3, 1]), (1, [2, 4, 3, 5, 1])):
        engine = FakeEngine()
        s = scheduler(engine, budget=10, chunk_size=10, max_running=max_running)
        for first, priority, length in requests:
            s.submit(Request(prompt(first, length), priority=priority))
        s.run_until_idle()
        assert [first for first, _ in prefills(engine)] == expected


def test_a_higher_priority_arrival_takes_the_next_step_ahead_of_a_long_prompts_remaining_chunks():
    for priority, expected in ((1, [(1, 8), (2, 8), (2, 8)]), (0, [(1, 8), (1, 8), (1, 8)])):
        engine = FakeEngine()
        s = scheduler(engine, budget=8, chunk_size=8)
        s.submit(Request(prompt(1, 40), priority=priority))
        s.step()
        # Prompt 2 has more left (40) than prompt 1 (32): only its higher priority puts it first.
        s.submit(Request(prompt(2, 40)))
        s.step()
        s.step()
        assert prefills(engine) == expected


def test_aging_lets_a_low_priority_prompt_run_under_a_stream_of_high_priority_ones():
    clock = Clock()
    engine = FakeEngine()
    s = scheduler(engine, budget=10, chunk_size=8, clock=clock)
    s.submit(Request(prompt(1, 40), priority=3))
    # A step every AGE_STEP_S / 4: 3 levels behind, prompt 1 ties with the stream after 12 steps, and having been
    # skipped for more than max_skipped_steps by then, it goes first at once.
    assert _long_prompt_served(engine, s, 14, clock, AGE_STEP_S / 4) == [False] * 11 + [True, False, False]


def test_a_prompt_yields_while_a_better_request_is_in_flight_and_takes_full_chunks_again_after():
    engine = FakeEngine()
    s = scheduler(engine, budget=64, chunk_size=32, min_chunk=8)  # yield_chunk: min_chunk
    s.submit(Request(prompt(1, 100), priority=5))
    s.step()  # alone: a full chunk
    s.submit(Request(prompt(2, 10), max_new_tokens=3))  # priority 0: prefills, then decodes twice
    for _ in range(4):
        s.step()
    # Prompt 2's step carries no chunk of prompt 1 (32 + 10 tokens would fit the budget of 64); while prompt 2
    # decodes, prompt 1 runs 8 tokens a step; once it finished, 32 again.
    assert prefills(engine) == [(1, 32), (2, 10), (1, 8), (1, 32), (1, 28)]
    assert [c[1] for c in engine.calls if c[0] == "decode"] == [8, 9]  # prompt 2's first token is 8


def test_an_explicit_yield_chunk_and_equal_priorities_that_never_yield():
    # Priority 1: the long prompt waits out the short one's step, then yields 16 tokens a step beside its decodes.
    # Priority 0: shortest first, and the long prompt shares the step and takes full chunks.
    for priority, expected in ((1, [(2, 4), (1, 16), (1, 16)]), (0, [(2, 4), (1, 32), (1, 32), (1, 32)])):
        engine = FakeEngine()
        s = scheduler(engine, budget=64, chunk_size=32, yield_chunk=16)
        s.submit(Request(prompt(1, 100), priority=priority))
        s.submit(Request(prompt(2, 4), max_new_tokens=10))  # priority 0, decoding throughout
        for _ in range(3):
            s.step()
        assert prefills(engine) == expected, priority


def test_aging_counts_from_a_prompts_last_chunk_so_a_prompt_that_runs_keeps_its_priority():
    clock = Clock()
    engine = FakeEngine()
    s = scheduler(engine, budget=64, chunk_size=32, min_chunk=8, max_running=2, clock=clock)
    s.submit(Request(prompt(1, 4), max_new_tokens=1000))  # priority 0, decoding throughout
    s.step()
    s.submit(Request(prompt(2, 200), priority=3))
    s.step()  # prompt 2 takes the second slot and yields: 8 tokens
    s.submit(Request(prompt(3, 50), priority=1))  # no slot left: it waits
    for _ in range(4):
        clock.now += AGE_STEP_S
        s.step()
    # Prompt 2 ran a chunk in every step, so it never waited a level's time: it keeps priority 3 (aged from its
    # arrival it would stand at 1 now, level with prompt 3).
    assert [(p.priority, p.remaining) for p in s.view.prefills] == [(3, 200 - 5 * 8), (1, 50)]
    assert prefills(engine) == [(1, 4)] + [(2, 8)] * 5


def test_a_request_that_arrives_while_a_step_decodes_is_planned_in_that_step():
    engine = FakeEngine()
    s = scheduler(engine, budget=64, chunk_size=32, min_chunk=8)
    s.submit(Request(prompt(1, 100), priority=5))
    s.submit(Request(prompt(2, 4), max_new_tokens=3))
    s.step()  # prompt 2 alone (prompt 1 is worse); it decodes from now on
    arrivals = [Request(prompt(3, 6))]

    def intake():  # the engine loop's part: submit what arrived since the step began
        while arrivals:
            s.submit(arrivals.pop())

    s.intake = intake
    calls_before = len(engine.calls)
    s.step()
    # The decode ran first, then prompt 3, which arrived during it, took the step's prefill ahead of prompt 1.
    assert [c[:2] for c in engine.calls[calls_before:] if c[0] in ("decode", "advance")] == [("decode", 8),
                                                                                            ("advance", 3)]
    assert s.records[2].first_token_at is not None


def test_a_new_request_of_the_best_priority_prefills_before_the_steps_decodes():
    # (priority of the new request, the calls of its step): better or equal to the decoding request's 0, it goes
    # first; worse, the decode does.
    for priority, expected in ((0, [("advance", 3), ("decode", 8)]), (-1, [("advance", 3), ("decode", 8)]),
                               (1, [("decode", 8), ("advance", 3)])):
        engine = FakeEngine()
        s = scheduler(engine, budget=64, chunk_size=32)
        s.submit(Request(prompt(2, 4), max_new_tokens=5))
        s.step()  # prompt 2 prefills; it decodes from now on
        s.submit(Request(prompt(3, 6), priority=priority))
        before = len(engine.calls)
        s.step()
        assert [c[:2] for c in engine.calls[before:] if c[0] in ("decode", "advance")] == expected, priority


def test_a_prompt_already_under_way_does_not_go_before_the_decodes():
    engine = FakeEngine()
    s = scheduler(engine, budget=64, chunk_size=32)
    s.submit(Request(prompt(1, 100)))
    s.submit(Request(prompt(2, 4), max_new_tokens=5))
    s.step()  # prompt 2 whole and prompt 1's first chunk
    before = len(engine.calls)
    s.step()
    assert [c[:2] for c in engine.calls[before:] if c[0] in ("decode", "advance")] == [("decode", 8), ("advance", 1)]


def test_equal_priorities_keep_shortest_first_however_long_each_waited():
    clock = Clock()
    engine = FakeEngine()
    s = scheduler(engine, budget=12, chunk_size=12, clock=clock)
    for first, length in ((1, 6), (2, 4), (3, 6), (4, 4)):
        s.submit(Request(prompt(first, length), priority=5))
        clock.now += 10 * AGE_STEP_S  # the earlier prompts waited tens of levels longer
    s.run_until_idle()
    assert prefills(engine) == [(2, 4), (4, 4), (1, 6), (3, 6)]


@pytest.mark.parametrize("priority", [1.0, "0", None, True])
def test_a_priority_that_is_not_an_integer_is_refused(priority):
    with pytest.raises(ValueError, match=f"priority must be an integer \\(lower runs sooner\\), got {priority!r}"):
        Request(prompt(1, 2), priority=priority)


def test_decodes_come_first_one_token_each_and_rotate_when_the_budget_is_short():
    engine = FakeEngine()
    s = scheduler(engine, budget=3)
    for first in (10, 20, 30):
        s.submit(Request([first], max_new_tokens=10))
    s.step()
    assert s.num_running == 3
    s.token_budget = 2  # fewer tokens per step than requests decoding
    for _ in range(3):
        assert s.step().decode_tokens == 2
    # FCFS: a request that decoded goes behind the one that did not.
    assert [c[1] for c in engine.calls if c[0] == "decode"] == [11, 21, 31, 12, 22, 32]


# ---- the batching window and slots --------------------------------------------------------------------------


def test_the_window_holds_new_prefills_and_next_step_at_says_until_when():
    clock = Clock()
    engine = FakeEngine()
    s = scheduler(engine, budget=20, batch_window_s=0.5, clock=clock)
    assert s.next_step_at() is None and s.idle
    s.submit(Request(prompt(1, 5)))
    clock.now = 0.2
    s.submit(Request(prompt(2, 6)))
    assert s.next_step_at() == 0.5 and s.step().prefill_tokens == 0 and s.num_waiting == 2
    clock.now = 0.49
    assert s.step().prefill_tokens == 0
    clock.now = 0.5
    stats = s.step()
    assert stats.prefill_tokens == 11 and s.records[0].queue_time == 0.5
    assert s.records[1].queue_time == pytest.approx(0.3) and s.records[1].ttft == pytest.approx(0.3)
    s.submit(Request(prompt(3, 19), max_new_tokens=3))
    assert s.next_step_at() == 0.5 + 0.5
    s.submit(Request(prompt(4, 1)))  # 19 + 1 waiting tokens fill the budget: no reason to wait
    assert s.next_step_at() == clock.now
    assert s.step().prefill_tokens == 20
    assert s.next_step_at() == clock.now  # a request is decoding: work right away


def test_slots_bound_what_runs_and_free_up_as_requests_finish():
    engine = FakeEngine()
    s = scheduler(engine, budget=32, chunk_size=4, max_running=2)
    for first in (1, 2, 3):
        s.submit(Request(prompt(first, 6), max_new_tokens=2))
    s.step()
    assert (s.num_running, s.num_waiting) == (2, 1)  # two prefills started
    assert s.kv_tokens == 8  # 4 + 4 tokens of their first chunks
    s.step()
    assert (s.num_running, s.num_waiting) == (2, 1) and s.kv_tokens == 12
    assert s.records[2].prefill_started_at is None
    s.step()  # both decode their second token and finish; their slots go to the third in the same step
    assert s.records[0].done and s.records[1].done and s.records[2].prefill_started_at is not None
    assert (s.num_running, s.num_waiting) == (1, 0) and s.kv_tokens == 4
    s.run_until_idle()
    assert s.records[2].tokens == [8, 9]


# ---- finishing: length, stop, eos, cancel, failures ------------------------------------------------------------


def test_finish_reasons_and_the_record_flags():
    engine = FakeEngine()
    s = scheduler(engine)
    s.submit(Request(prompt(1, 3), max_new_tokens=4, request_id="length"))
    s.submit(Request(prompt(2, 3), max_new_tokens=9, eos_token_id=10, request_id="eos"))
    s.submit(Request(prompt(3, 3), max_new_tokens=9, stop_token_ids=(99, 9), request_id="stop"))
    s.submit(Request(prompt(4, 3), max_new_tokens=9, eos_token_id=8, request_id="first-is-eos"))
    s.run_until_idle()
    r = s.records
    assert r["length"].tokens == [8, 9, 10, 11] and r["length"].finish_reason == LENGTH
    assert r["eos"].tokens == [8, 9, 10] and r["eos"].finish_reason == STOP
    assert r["stop"].tokens == [8, 9] and r["stop"].finish_reason == STOP
    assert r["first-is-eos"].tokens == [8] and r["first-is-eos"].finish_reason == STOP
    assert all(x.finished and not x.cancelled and x.done and x.error is None for x in r.values())


def test_cancel_a_waiting_a_prefilling_and_a_decoding_request():
    engine = FakeEngine()
    s = scheduler(engine, budget=8, chunk_size=4)
    s.submit(Request(prompt(1, 2), max_new_tokens=100, request_id="decoding"))
    s.submit(Request(prompt(2, 20), request_id="prefilling"))
    s.step()
    s.step()
    s.submit(Request(prompt(3, 5), request_id="waiting"), arrived_at=99.0)
    decoding_kv = s._running[0].first.kv
    assert s.records["prefilling"].prefill_started_at is not None
    for rid in ("waiting", "prefilling", "decoding"):
        record = s.cancel(rid)
        assert record.cancelled and not record.finished and record.finish_reason == CANCELLED and record.done
    assert engine.cancelled == [3, 2] and decoding_kv.released
    assert s.idle and s.kv_tokens == 0 and s.num_waiting == 0
    with pytest.raises(KeyError, match="no queued or running request 'decoding'"):
        s.cancel("decoding")
    assert s.forget("decoding").finish_reason == CANCELLED and "decoding" not in s.records


def test_a_failing_prefill_does_not_hold_up_the_prefills_after_it_in_that_step():
    engine = FakeEngine()
    engine.fail_prefill.add(1)
    s = scheduler(engine)
    s.submit(Request(prompt(1, 3), request_id="fails"))
    s.submit(Request(prompt(2, 4), request_id="fine"))
    stats = s.step()
    assert stats.finished == ("fails", "fine") and stats.emitted == (("fine", 8),)
    assert s.records["fails"].error == "RuntimeError: injected prefill failure"


def test_a_failing_decode_does_not_hold_up_the_decodes_after_it_in_that_step():
    engine = FakeEngine()
    engine.fail_decode.add(8)  # the first decode of "fails" feeds its first token, 8
    s = scheduler(engine)
    s.submit(Request(prompt(1, 2), max_new_tokens=3, request_id="fails"))
    s.submit(Request([2, 30], max_new_tokens=3, request_id="fine"))
    s.step()  # both prefill: first tokens 8 and 31
    stats = s.step()
    assert stats.finished == ("fails",) and stats.emitted == (("fine", 32),) and stats.decode_tokens == 1


def test_forget_refuses_a_request_in_flight():
    s = scheduler()
    s.submit(Request(prompt(1, 2), max_new_tokens=3, request_id="a"))
    with pytest.raises(ValueError, match="'a' is still in flight"):
        s.forget("a")
    s.step()
    with pytest.raises(ValueError, match="still in flight"):
        s.forget("a")
    s.run_until_idle()
    assert s.forget("a").tokens == [8, 9, 10]
    with pytest.raises(KeyError):
        s.forget("a")


def test_a_failing_decode_prefill_or_publish_ends_that_request_only():
    engine = FakeEngine()
    engine.fail_prefill.add(2)
    engine.fail_publish.add(3)
    engine.fail_decode.add(9)  # request 4's second decode feeds token 9
    finished: list = []
    s = scheduler(engine, budget=64)
    s.on_finish = finished.append
    s.submit(Request(prompt(1, 3), max_new_tokens=2, request_id="fine"))
    s.submit(Request(prompt(2, 3), max_new_tokens=3, request_id="prefill"))
    s.submit(Request(prompt(3, 4), max_new_tokens=3, request_id="publish"))
    s.submit(Request([6, 7], max_new_tokens=5, request_id="decode"))
    s.run_until_idle()
    r = s.records
    assert r["prefill"].finish_reason == ERROR and r["prefill"].error == "RuntimeError: injected prefill failure"
    assert r["prefill"].finished and not r["prefill"].cancelled and engine.cancelled == [2]
    assert r["publish"].finish_reason == ERROR and r["publish"].tokens == [8]  # the first token was out already
    assert "publish failure" in r["publish"].error
    assert r["decode"].finish_reason == ERROR and r["decode"].tokens == [8, 9] and "decode failure" in r["decode"].error
    assert r["fine"].finish_reason == LENGTH and r["fine"].tokens == [8, 9]
    assert sorted(finished, key=str) == sorted(["fine", "prefill", "publish", "decode"], key=str)
    assert s.kv_tokens == 0


# ---- the bucketed path ---------------------------------------------------------------------------------------


def test_cold_prompts_that_fit_a_bucket_prefill_together_and_the_rest_one_by_one():
    engine = FakeEngine(buckets=(8, 16), cached={4: 3})
    s = scheduler(engine, budget=64, chunk_size=16)
    s.submit(Request(prompt(1, 5)))
    s.submit(Request(prompt(2, 40)))  # longer than a chunk: its first 16 fit the 16 bucket
    s.submit(Request(prompt(3, 12)))
    s.submit(Request(prompt(4, 9)))  # a prefix-cache hit: not cold, so it takes the KV path
    stats = s.step()
    together = [c for c in engine.calls if c[0] == "together"]
    assert together == [("together", ((1, 5), (3, 12), (2, 16)))]
    assert [c[1:] for c in engine.calls if c[0] == "advance"] == [(4, 6)]
    assert stats.batched_rows == 3 and stats.prefill_tokens == 5 + 6 + 12 + 16
    assert {rid for rid, _ in stats.emitted} == {0, 2, 3}
    assert s.step().batched_rows == 0  # the long prompt continues on the KV path
    assert [c[1:] for c in engine.calls if c[0] == "advance"][1:] == [(2, 16)]


def test_two_bucketed_prefills_count_as_two_batched_rows():
    engine = FakeEngine(buckets=(8,))
    s = scheduler(engine)
    s.submit(Request(prompt(1, 5)))
    s.submit(Request(prompt(2, 6)))
    assert s.step().batched_rows == 2 and engine.calls[0] == ("together", ((1, 5), (2, 6)))


def test_a_single_bucketed_prefill_is_not_counted_as_batched():
    engine = FakeEngine(buckets=(8,))
    s = scheduler(engine)
    s.submit(Request(prompt(1, 5)))
    assert s.step().batched_rows == 0 and engine.calls[0] == ("together", ((1, 5),))


def test_a_failing_batch_fails_each_of_its_requests_and_nothing_else():
    engine = FakeEngine(buckets=(8,))
    engine.fail_together = True
    s = scheduler(engine, budget=64)
    s.submit(Request(prompt(1, 5), request_id="a"))
    s.submit(Request(prompt(2, 6), request_id="b"))
    s.submit(Request(prompt(3, 20), request_id="kv-path"))
    stats = s.step()
    assert stats.finished == ("a", "b", "kv-path") and engine.cancelled == [1, 2]
    assert all(s.records[r].finish_reason == ERROR for r in ("a", "b"))
    assert all(s.records[r].error == "RuntimeError: injected batch failure" for r in ("a", "b"))
    assert s.records["a"].prefill_started_at == 0.0
    assert s.records["kv-path"].finish_reason == LENGTH


# ---- what callers see: callbacks, emitted tokens, times ------------------------------------------------------


def test_tokens_and_finishes_are_reported_as_they_happen_with_their_times(monkeypatch):
    clock = Clock()
    engine = FakeEngine()
    events = []
    s = scheduler(engine, clock=clock)
    s.on_token = lambda rid, token: events.append(("token", rid, token, clock.now))
    s.on_finish = lambda rid: events.append(("finish", rid, clock.now))
    real_advance = FakeJob.advance

    def slow_advance(job, n, *, publish=True):
        clock.now += 1.0  # each prefill forward takes a second
        return real_advance(job, n, publish=publish)

    monkeypatch.setattr(FakeJob, "advance", slow_advance)
    s.submit(Request(prompt(1, 2), max_new_tokens=2, request_id="a"))
    s.submit(Request(prompt(2, 3), max_new_tokens=1, request_id="b"))
    stats = s.step()
    assert stats.emitted == (("a", 8), ("b", 8)) and stats.finished == ("b",)
    assert events == [("token", "a", 8, 1.0), ("token", "b", 8, 2.0), ("finish", "b", 2.0)]
    a = s.records["a"]
    assert a.first_token_at == 1.0 and a.token_times == [1.0] and a.ttft == 1.0 and a.queue_time == 0.0
    clock.now = 5.0
    assert s.step().emitted == (("a", 9),) and events[-2:] == [("token", "a", 9, 5.0), ("finish", "a", 5.0)]
    assert a.token_times == [1.0, 5.0] and a.max_token_gap == 4.0


def test_a_seeded_request_decodes_with_one_generator_for_its_whole_life():
    engine = FakeEngine()
    s = scheduler(engine)
    s.submit(Request(prompt(1, 2), max_new_tokens=4, sampling=Sampling(temperature=1.0, seed=3)))
    s.submit(Request([2, 30], max_new_tokens=4))  # greedy: no generator
    s.run_until_idle()
    seeded = [generator for token, generator in engine.decoded if token < 30]
    greedy = [generator for token, generator in engine.decoded if token > 30]
    # One random stream per request, continued step after step: the same seed gives the same tokens.
    assert len(seeded) == 3 and seeded[0] is not None and all(g is seeded[0] for g in seeded)
    assert seeded[0].initial_seed() == 3
    assert greedy == [None] * 3
    assert engine.started_with == [(1, Sampling(temperature=1.0, seed=3)), (2, GREEDY)]  # the engine samples the first


def test_the_first_tokens_time_is_the_moment_it_became_the_first_token():
    s = scheduler(clock=TickingClock())
    s.submit(Request(prompt(1, 3), max_new_tokens=2))
    s.run_until_idle()
    record = s.records[0]
    assert record.token_times[0] == record.first_token_at < record.token_times[1]


def test_record_properties_before_anything_happened():
    record = RequestRecord("r", prompt_tokens=10, submitted_at=2.0, cached_tokens=4)
    assert record.ttft is None and record.queue_time is None and record.computed_tokens == 6
    assert record.max_token_gap == 0.0 and not record.done
    record.token_times = [3.0, 3.5, 5.0, 5.25]
    assert record.max_token_gap == 1.5


def test_a_step_whose_decodes_take_the_whole_budget_plans_no_prefill():
    # Two running requests decode one token each and use the budget of 2 up: a waiting prompt gets no zero-token
    # chunk (FakeJob.advance refuses n < 1), it waits for a step with room and then completes normally.
    engine = FakeEngine()
    s = scheduler(engine, budget=2, chunk_size=4, batch_window_s=0.0)
    s.submit(Request(prompt(1, 1), max_new_tokens=4))
    s.submit(Request(prompt(2, 1), max_new_tokens=4))
    s.step()  # both prefill (one token each) and start decoding
    s.submit(Request(prompt(3, 3), max_new_tokens=1))
    s.step()  # two decodes fill the budget
    assert all(c[1] != 3 for c in engine.calls if c[0] == "advance")
    records = s.run_until_idle()
    assert [records[i].finish_reason for i in sorted(records)] == [LENGTH, LENGTH, LENGTH]
    assert ("advance", 3, 0) not in engine.calls


# ---- batched decode ------------------------------------------------------------------------------------------


def batches(engine) -> list[tuple]:
    return [c[1] for c in engine.calls if c[0] == "batch"]


def test_all_running_requests_decode_in_one_batch_per_step_and_rotate_when_the_budget_is_short():
    engine = FakeEngine()
    s = scheduler(engine, budget=3)
    for first in (10, 20, 30):
        s.submit(Request([first], max_new_tokens=10))
    s.step()
    assert batches(engine) == []  # prefills only
    assert s.step().decode_tokens == 3 and batches(engine) == [(11, 21, 31)]
    s.token_budget = 2
    s.step()
    s.step()
    # The two that decoded go behind the one that did not; each step is one call.
    assert batches(engine)[1:] == [(12, 22), (32, 13)]


def test_min_chunk_is_validated():
    with pytest.raises(ValueError, match="min_chunk must be >= 1, got 0"):
        scheduler(min_chunk=0)


def test_a_chunked_prompt_takes_the_budget_left_and_a_short_one_waits_to_run_whole():
    engine = FakeEngine()
    s = scheduler(engine, budget=100, chunk_size=100, min_chunk=16)
    s.submit(Request(prompt(1, 400)))
    s.submit(Request(prompt(2, 60)))
    s.submit(Request(prompt(3, 50)))
    s.step()
    # Shortest first: 50, then the 60 does not fit the 50 left whole and waits; the long prompt takes the 50.
    assert prefills(engine) == [(3, 50), (1, 50)]
    s.step()
    assert prefills(engine)[2:] == [(2, 60), (1, 40)]  # 40 left: the long prompt takes them (>= min_chunk 16)
    s.submit(Request(prompt(4, 90)))
    s.step()
    assert prefills(engine)[4:] == [(4, 90)]  # 10 left < min_chunk: no sliver for the long prompt
    stats = s.step()
    assert (stats.decode_tokens, stats.prefill_tokens) == (0, 100) and prefills(engine)[5:] == [(1, 100)]



def test_the_leftover_rule_at_its_bounds():
    # 40 left, more than min_chunk 36, but a prompt of exactly one chunk is not chunked: it waits to run whole.
    engine = FakeEngine()
    s = scheduler(engine, budget=100, chunk_size=64, min_chunk=36)
    s.submit(Request(prompt(1, 64)))
    s.submit(Request(prompt(2, 60)))
    s.step()
    assert prefills(engine) == [(2, 60)]
    # 36 left, exactly min_chunk: enough for a chunk of a prompt longer than one chunk.
    engine = FakeEngine()
    s = scheduler(engine, budget=100, chunk_size=64, min_chunk=36)
    s.submit(Request(prompt(1, 200)))
    s.submit(Request(prompt(2, 64)))
    s.step()
    assert prefills(engine) == [(2, 64), (1, 36)]

def test_the_leftover_rule_applies_to_chunked_scheduling_only():
    engine = FakeEngine()
    s = scheduler(engine, budget=100, min_chunk=1)  # no chunking: prompts run whole or not at all
    s.submit(Request(prompt(1, 400)))
    s.submit(Request(prompt(2, 60)))
    s.step()
    assert prefills(engine) == [(2, 60)]


def test_a_step_never_exceeds_its_budget_under_a_stream_of_arrivals_beside_a_long_prompt():
    engine = FakeEngine()
    budget = 64
    s = scheduler(engine, budget=budget, chunk_size=48, min_chunk=8, max_skipped_steps=3)
    s.submit(Request(prompt(1, 1000), max_new_tokens=4, request_id="long"))
    steps = []
    for step in range(120):
        if step % 2 == 0:
            s.submit(Request(prompt(100 + step, 5 + step % 23), max_new_tokens=6))
        steps.append(s.step())
    s.run_until_idle()
    assert all(st.decode_tokens + st.prefill_tokens <= budget for st in steps)
    assert max(st.decode_tokens + st.prefill_tokens for st in steps) == budget  # the budget is used, not wasted
    assert s.records["long"].finish_reason == LENGTH
    # The long prompt never waits more than max_skipped_steps steps in a row for a chunk.
    long_steps = [i for i, c in enumerate(steps) if c.prefill_tokens and any(
        rid == "long" for rid, _ in c.emitted)]
    assert long_steps, "the long prompt produced its first token while the short ones kept arriving"


def test_a_callback_that_cancels_requests_of_the_batch_being_decoded():
    engine = FakeEngine()
    s = scheduler(engine)
    for rid, first in (("a", 10), ("b", 20), ("c", 30), ("d", 40)):
        s.submit(Request([first], max_new_tokens=5, request_id=rid))
    s.step()
    kvs = {run.request.request_id: run.first.kv for run in s._running}
    seen = []

    def on_token(rid, token):
        seen.append((rid, token))
        if rid == "a":
            s.cancel("c")  # a later row of the same batch: its token must not be emitted
        if rid == "b":
            s.cancel("b")  # itself, from its own callback

    s.on_token = on_token
    stats = s.step()
    assert batches(engine) == [(11, 21, 31, 41)]
    assert seen == [("a", 12), ("b", 22), ("d", 42)]
    assert stats.emitted == (("a", 12), ("b", 22), ("d", 42)) and stats.decode_tokens == 3
    assert s.records["c"].tokens == [31] and s.records["c"].cancelled and kvs["c"].released
    assert s.records["b"].tokens == [21, 22] and s.records["b"].cancelled and kvs["b"].released
    s.on_token = None
    s.run_until_idle()
    assert s.records["a"].tokens == [11, 12, 13, 14, 15] and s.records["d"].finish_reason == LENGTH
    assert batches(engine)[1] == (12, 42) and s.kv_tokens == 0  # FakeKV refuses a second release


def test_a_cancel_between_steps_shrinks_the_batch():
    engine = FakeEngine()
    s = scheduler(engine)
    for rid, first in (("a", 10), ("b", 20), ("c", 30)):
        s.submit(Request([first], max_new_tokens=4, request_id=rid))
    s.step()
    s.step()
    s.cancel("b")
    s.step()
    assert batches(engine) == [(11, 21, 31), (12, 32)]
    s.run_until_idle()
    assert s.records["a"].tokens == [11, 12, 13, 14] and s.records["c"].tokens == [31, 32, 33, 34]
    assert s.records["b"].tokens == [21, 22] and s.records["b"].cancelled


def test_a_failing_batch_call_ends_its_rows_and_the_prefills_of_the_step_go_on():
    engine = FakeEngine()
    s = scheduler(engine)
    s.submit(Request([10], max_new_tokens=3, request_id="a"))
    s.submit(Request([20], max_new_tokens=3, request_id="b"))
    s.step()
    engine.fail_batch = True
    s.submit(Request(prompt(3, 4), max_new_tokens=1, request_id="new"))
    stats = s.step()  # the new request prefills first (before the decodes), then the failing batch
    assert stats.finished == ("new", "a", "b") and stats.decode_tokens == 0
    assert s.records["a"].error == "RuntimeError: injected engine bug" and s.records["a"].finish_reason == ERROR
    assert s.records["new"].finish_reason == LENGTH and s.records["new"].tokens == [8]
    assert s.idle and s.kv_tokens == 0
