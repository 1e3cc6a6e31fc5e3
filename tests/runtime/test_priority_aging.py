"""Issue 40, items 3 and 4: bounded aging, no inversion, and a TTFT estimate that holds under a flood.

The engine is the scripted one of test_scheduler_logic.py, on a fake clock that each forward moves by exactly what
the scheduler's cost model predicts for it: the estimate's only error left is the scheduling it models, which is
what these tests check. No wall clock anywhere.
"""

from __future__ import annotations

import math

from ttftc.runtime.scheduler import MAX_AGE_S, Request, StepScheduler
from ttftc.runtime.ttft_estimate import QueuedPrefill, simulate
from tests.runtime.test_scheduler_logic import Clock, FakeEngine, prompt


class TimedEngine(FakeEngine):
    """Each forward takes the time the cost model predicts (its fit then stays the prior's)."""

    def __init__(self, clock: Clock):
        super().__init__()
        self.clock = clock
        self.model = None  # the scheduler's cost model, set once it exists

    def start(self, ids, *, tenant=None, sampling=None):
        job = super().start(ids, tenant=tenant, sampling=sampling)
        advance = job.advance

        def timed(n, *, publish=True):
            self.clock.now += self.model.prefill_s(n, job.position)
            return advance(n, publish=publish)

        job.advance = timed
        return job

    def decode_batch(self, rows):
        self.clock.now += self.model.decode_s(len(rows))
        return super().decode_batch(rows)


def timed_scheduler(**kwargs) -> tuple[StepScheduler, Clock]:
    clock = Clock()
    engine = TimedEngine(clock)
    s = StepScheduler(engine, 512, chunk_size=128, clock=clock, **kwargs)
    engine.model = s.cost_model
    return s, clock


def estimate(s: StepScheduler, ids: list[int], priority: int, max_new_tokens: int) -> float:
    """What EngineLoop.estimate computes for a request submitted now."""
    new = QueuedPrefill(priority, len(ids), 0, len(s.view.prefills), max_new_tokens - 1)
    return simulate(s.cost_model, s.view, s.shape, new, s.clock()).ttft_s


def step_until_first_token(s: StepScheduler, clock: Clock, request_id, *, arrivals=lambda step: (),
                           limit_s: float = math.inf) -> float:
    """Steps (submitting `arrivals(step)` before each) until `request_id` has its first token; the longest step."""
    longest, step = 0.0, 0
    while s.records[request_id].first_token_at is None and clock.now < limit_s:
        for request in arrivals(step):
            s.submit(request)
        started = clock.now
        s.step()
        longest = max(longest, clock.now - started)
        step += 1
    return longest


def test_a_fresh_request_is_not_queued_behind_a_backlog_that_aged_to_its_priority():
    """Item 4: 200 prompts of 2000 tokens at priority 0 wait; a new priority -1 request comes after they aged."""
    s, clock = timed_scheduler()
    for k in range(200):
        s.submit(Request(prompt(1000 + k, 2000), request_id=f"backlog-{k}"))
    for _ in range(6):
        s.step()  # a few of them run; the rest are skipped (starving) and all wait
    clock.now += 2.0  # long enough to age two levels: to -1 once a -1 request is queued
    ids = prompt(1, 4)
    promised = estimate(s, ids, -1, 2)
    record = s.submit(Request(ids, max_new_tokens=2, priority=-1, request_id="fresh"))
    one_step = step_until_first_token(s, clock, "fresh")
    assert record.ttft <= promised + one_step
    # It ran in the next step, beside at most the aged share of it, not after the 200 prompts (minutes of work).
    assert record.ttft <= 2 * one_step
    backlog_left = sum(s.records[f"backlog-{k}"].first_token_at is None for k in range(200))
    assert backlog_left >= 190


def test_a_flood_at_the_best_priority_cannot_starve_a_default_request():
    """Item 3, in-process (HTTP refuses the priority, tests/security/test_priority_privilege.py): a stream of
    priority -2**31 prompts that fills every step; a priority-0 request still gets its first token once it aged."""
    s, clock = timed_scheduler()
    s.submit(Request(prompt(1, 4), max_new_tokens=1, request_id="victim"))
    counter = iter(range(10**6))

    def flood(step):  # 6 x 100 tokens a step: more than the budget of 512
        return [Request(prompt(10_000 + next(counter), 100), priority=-(2**31)) for _ in range(6)]

    step_until_first_token(s, clock, "victim", arrivals=flood, limit_s=MAX_AGE_S + 30)
    ttft = s.records["victim"].ttft
    assert ttft is not None, "starved: no first token"
    # Aged to the top after MAX_AGE_S, then reserved a chunk within max_skipped_steps more steps.
    assert ttft <= MAX_AGE_S + 10


def test_a_flood_of_allowed_priorities_never_delays_a_priority_0_request_past_its_estimate():
    """The done-when: requests of the priorities a default client may send (0 and later) keep coming, some queued
    before the victim (a backlog of priority 5 that waited long enough to age to 0), some after; the victim's first
    token comes within its estimate plus one step."""
    s, clock = timed_scheduler()
    for k in range(40):
        s.submit(Request(prompt(2000 + k, 300), priority=5, request_id=f"old-{k}"))
    for k in range(3):
        s.submit(Request(prompt(3000 + k, 600), request_id=f"long-{k}"))  # priority 0, longer than the victim
    for _ in range(6):
        s.step()
    clock.now += 10.0  # the priority-5 backlog has aged to 0 and most of it is starving
    ids = prompt(1, 4)
    promised = estimate(s, ids, 0, 2)
    record = s.submit(Request(ids, max_new_tokens=2, request_id="victim"))
    counter = iter(range(10**6))

    def flood(step):  # each step: a priority-0 prompt as long as the victim, and three worse ones
        return [Request(prompt(10_000 + next(counter), length), priority=priority)
                for priority, length in ((0, 4), (1, 200), (7, 50), (2**31 - 1, 400))]

    one_step = step_until_first_token(s, clock, "victim", arrivals=flood)
    assert record.ttft <= promised + one_step
