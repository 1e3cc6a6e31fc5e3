"""The TTFT estimate: the online cost model's fit, the replay of the scheduler's steps over the queue ahead, and the
view the scheduler publishes for it. The replay is checked against the real StepScheduler on a scripted engine
whose forwards advance a clock by a known cost, so an exact cost model must predict each TTFT exactly."""

from __future__ import annotations

import random

import pytest

from tests.runtime.test_scheduler_logic import Clock, FakeEngine, FakeJob, TickingClock, prompt
from ttftc.runtime.scheduler import Request, StepScheduler
from ttftc.runtime.ttft_estimate import (CostModel, CostPrior, QueuedDecode, QueuedPrefill, QueueView, StepShape,
                                        simulate)

# A known cost: seconds per forward, per token, per token x context token; per decode step and row.
TRUE = dict(forward_s=0.002, token_s=1e-4, attend_s=1e-7, step_s=0.003, row_s=5e-4)


def true_prefill(n: int, ctx: int) -> float:
    return TRUE["forward_s"] + TRUE["token_s"] * n + TRUE["attend_s"] * n * (ctx + n / 2)


def true_decode(rows: int) -> float:
    return TRUE["step_s"] + TRUE["row_s"] * rows


def exact_model() -> CostModel:
    """A model whose prior is the true cost: its pseudo-measurements fit it exactly, and so does every real one."""
    return CostModel(CostPrior(**TRUE, weight=1.0, decay=1.0))


def feed(model: CostModel, count: int, seed: int = 0) -> None:
    """`count` prefill forwards (1 to 4 rows, cold or after a cached prefix) and decode steps of the true cost."""
    rng = random.Random(seed)
    for _ in range(count):
        rows = [(rng.randint(1, 512), rng.choice((0, 0, 128, 1024, 3000))) for _ in range(rng.choice((1, 1, 2, 4)))]
        # one forward: its fixed cost once, each row's tokens and attention
        model.observe_prefill(rows, TRUE["forward_s"] + sum(true_prefill(n, ctx) - TRUE["forward_s"]
                                                            for n, ctx in rows))
        rows_decoding = rng.randint(1, 32)
        model.observe_decode(rows_decoding, true_decode(rows_decoding))


def test_the_fit_recovers_a_known_linear_cost_from_measurements():
    model = CostModel(CostPrior(weight=1e-3, decay=1.0))  # a prior 2.5x to 5x off, worth little
    feed(model, 400)
    fit = model.coefficients()
    for term, value in TRUE.items():
        assert fit[term] == pytest.approx(value, rel=0.01), term
    assert model.prefill_measurements == model.decode_measurements == 400


def test_with_the_default_prior_the_fit_predicts_typical_forwards_within_ten_percent():
    model = CostModel()
    feed(model, 400)
    for n, ctx in ((32, 0), (128, 0), (128, 2048), (512, 512)):
        assert model.prefill_s(n, ctx) == pytest.approx(true_prefill(n, ctx), rel=0.10), (n, ctx)
    for rows in (1, 4, 16):
        assert model.decode_s(rows) == pytest.approx(true_decode(rows), rel=0.10), rows


def test_the_fit_follows_a_machine_that_slows_down():
    model = CostModel()
    for _ in range(300):
        model.observe_prefill([(128, 0)], 0.010)
    for _ in range(300):
        model.observe_prefill([(128, 0)], 0.030)  # the machine got three times slower (another load arrived)
    assert model.prefill_s(128, 0) == pytest.approx(0.030, rel=0.05)


def test_before_any_measurement_the_prior_gives_sane_costs_and_a_cached_prefix_is_cheaper_not_free():
    model = CostModel()
    assert 0 < model.prefill_s(16, 0) < model.prefill_s(128, 0) < model.prefill_s(512, 0) < 1.0
    cold = model.prefill_s(1024, 0)
    warm = model.prefill_s(128, 896)  # the same prompt with 896 tokens cached
    assert 0 < warm < cold / 3
    assert model.prefill_s(128, 896) > model.prefill_s(128, 0), "the cached KV is still attended to"
    assert model.decode_s(0) == 0 and 0 < model.decode_s(1) < model.decode_s(8)


def test_measurements_a_clock_cannot_time_are_ignored():
    model = CostModel()
    before = model.coefficients()
    model.observe_prefill([(64, 0)], 0.0)
    model.observe_prefill([], 0.5)
    model.observe_decode(3, float("nan"))
    assert model.coefficients() == before and model.prefill_measurements == model.decode_measurements == 0


def test_a_bad_prior_is_refused():
    with pytest.raises(ValueError, match="CostPrior.token_s"):
        CostPrior(token_s=-1.0)
    with pytest.raises(ValueError, match="decay"):
        CostPrior(decay=0.0)


def test_queue_ahead_counts_better_and_equal_priorities_and_skips_worse_ones():
    model = exact_model()
    shape = StepShape(token_budget=100, chunk_size=None)
    new = QueuedPrefill(priority=1, remaining=50, position=0, order=99)
    ahead = QueuedPrefill(priority=0, remaining=80, position=0, order=0)
    tie_shorter = QueuedPrefill(priority=1, remaining=40, position=0, order=1)
    behind = QueuedPrefill(priority=2, remaining=30, position=0, order=2)
    alone = simulate(model, QueueView(), shape, new, now=0.0)
    assert alone.ttft_s == pytest.approx(true_prefill(50, 0)) and alone.ahead_tokens == 0
    # 80 first (a better priority), then 40 (the shorter of priority 1) with ours beside it in the next step.
    view = QueueView(prefills=(behind, tie_shorter, ahead))
    queued = simulate(model, view, shape, new, now=0.0)
    assert queued.ttft_s == pytest.approx(true_prefill(80, 0) + true_prefill(40, 0) + true_prefill(50, 0))
    assert queued.ahead_tokens == 120
    # The prompt of priority 2 runs after ours: it is in the drain time, not in the TTFT.
    decodes = 0.0  # each prompt generates one token only (decode_tokens=0): nothing decodes
    assert queued.drain_s == pytest.approx(queued.ttft_s + true_prefill(30, 0) + decodes)


def test_queue_ahead_includes_the_step_under_way_the_decodes_and_the_cached_prefix():
    model = exact_model()
    shape = StepShape(token_budget=64, chunk_size=32, min_chunk=8)
    new = QueuedPrefill(priority=0, remaining=40, position=64, order=5)  # 64 tokens cached
    view = QueueView(decoding=(QueuedDecode(0, 10), QueuedDecode(0, 10)), step_ends_at=2.5)
    estimate = simulate(model, view, shape, new, now=2.0)
    # 0.5 s left of the step under way; then two steps, each decoding the two sequences: 32 tokens, then 8.
    expected = 0.5 + 2 * true_decode(2) + true_prefill(32, 64) + true_prefill(8, 96)
    assert estimate.ttft_s == pytest.approx(expected)


def test_an_idle_engine_adds_the_batching_window():
    model = exact_model()
    shape = StepShape(token_budget=64, batch_window_s=0.004)
    estimate = simulate(model, QueueView(), shape, QueuedPrefill(0, 10, 0, 0), now=0.0)
    assert estimate.ttft_s == pytest.approx(0.004 + true_prefill(10, 0))


class TimedJob(FakeJob):
    def advance(self, n, *, publish=True):
        context = self.position
        result = super().advance(n, publish=publish)
        self.engine.clock.now += true_prefill(n, context)
        return result


class TimedEngine(FakeEngine):
    """The scripted engine, whose forwards take the true cost on the scheduler's clock."""

    def __init__(self, clock: Clock, cached=None):
        super().__init__(cached=cached)
        self.clock = clock

    def start(self, prompt, *, tenant=None, sampling=None):
        self.started_with.append((prompt[0], sampling))
        return TimedJob(self, prompt, tenant, self.cached.get(prompt[0], 0))

    def decode_batch(self, rows):
        results = super().decode_batch(rows)
        self.clock.now += true_decode(len(rows))
        return results


@pytest.mark.parametrize("chunk, budget", [(None, 256), (32, 96), (64, 64)])
def test_the_replay_predicts_the_schedulers_ttft_exactly_under_an_exact_cost_model(chunk, budget):
    clock = Clock()
    engine = TimedEngine(clock, cached={6: 48})
    # No starvation override: the replay orders by (priority, remaining, arrival) only.
    s = StepScheduler(engine, budget, chunk_size=chunk, clock=clock, min_chunk=16, cost_model=exact_model(),
                      max_skipped_steps=10**9)
    # A queue of mixed priorities, lengths and decodes, one with a cached prefix; some steps run before ours.
    queue = [(1, 0, 200, 5), (2, 1, 40, 3), (3, -1, 90, 8), (4, 0, 20, 2), (5, 2, 60, 4)]
    for first, priority, length, tokens in queue:
        s.submit(Request(prompt(first, length), max_new_tokens=tokens, priority=priority))
    s.step()
    s.step()
    for first, priority, length in ((6, 0, 100), (7, 1, 30), (8, -1, 150)):
        view, now = s.view, clock()
        job = engine.start(prompt(first, length))  # what the scheduler will see of it (its cached prefix)
        new = QueuedPrefill(priority, job.remaining, job.position, order=float("inf"), decode_tokens=2)
        estimate = simulate(s.cost_model, view, s.shape, new, now)
        record = s.submit(Request(prompt(first, length), max_new_tokens=3, priority=priority))
        while record.first_token_at is None:
            s.step()
        assert record.ttft == pytest.approx(estimate.ttft_s, rel=1e-9), (first, chunk)
    s.run_until_idle()


def timed_scheduler(budget: int) -> tuple[Clock, StepScheduler]:
    """A scheduler over the timed engine with an exact cost model, 32-token chunks, and no starvation override."""
    clock = Clock()
    return clock, StepScheduler(TimedEngine(clock), budget, chunk_size=32, clock=clock, min_chunk=16,
                                cost_model=exact_model(), max_skipped_steps=10**9)


@pytest.mark.parametrize("priority", [0, 1, -1])
def test_the_replay_predicts_a_request_that_arrives_while_a_step_decodes_exactly(priority):
    clock, s = timed_scheduler(96)
    s.submit(Request(prompt(1, 300), priority=1))
    s.submit(Request(prompt(2, 20), max_new_tokens=6))
    s.step()
    estimates, records = [], []

    def arrive():  # called once the step's decodes ran: the view says so, and the request joins this step
        if records:
            return
        assert s.view.joins_step and s.view.step_ends_at == pytest.approx(clock())
        new = QueuedPrefill(priority, 40, 0, order=float("inf"), decode_tokens=1)
        estimates.append(simulate(s.cost_model, s.view, s.shape, new, clock()))
        records.append(s.submit(Request(prompt(3, 40), max_new_tokens=2, priority=priority)))

    s.intake = arrive
    while not records or records[0].first_token_at is None:
        s.step()
    assert records[0].ttft == pytest.approx(estimates[0].ttft_s, rel=1e-9)
    s.run_until_idle()


@pytest.mark.parametrize("priority", [-1, 0, 1])
def test_the_replay_predicts_a_new_request_that_goes_before_the_decodes_exactly(priority):
    clock, s = timed_scheduler(64)
    s.submit(Request(prompt(1, 10), max_new_tokens=8))
    s.submit(Request(prompt(2, 90), priority=1))
    s.step()  # prompt 1 prefills (prompt 2, worse, waits); it decodes from now on
    new = QueuedPrefill(priority, 30, 0, order=float("inf"), decode_tokens=1)
    estimate = simulate(s.cost_model, s.view, s.shape, new, clock())
    record = s.submit(Request(prompt(3, 30), max_new_tokens=2, priority=priority))
    while record.first_token_at is None:
        s.step()
    assert record.ttft == pytest.approx(estimate.ttft_s, rel=1e-9)
    if priority <= 0:  # it went before the decode of its step: its TTFT is its own forward
        assert record.ttft == pytest.approx(true_prefill(30, 0), rel=1e-9)
    else:
        assert record.ttft > true_prefill(30, 0) + true_decode(1)
    s.run_until_idle()


def test_the_scheduler_times_each_forward_into_its_cost_model():
    # A clock that moves on every read: each forward and decode batch is timed (1 s each), nothing is dropped.
    s = StepScheduler(FakeEngine(), 64, chunk_size=32, clock=TickingClock())
    s.submit(Request(prompt(1, 70), max_new_tokens=3))
    s.run_until_idle()
    # 70 tokens: chunks of 32, 32 and 6, over three steps; then two decode steps of one row.
    assert s.cost_model.prefill_measurements == 3
    assert s.cost_model.decode_measurements == 2


def test_the_view_holds_aged_priorities_remaining_tokens_and_decodes():
    clock = Clock()
    s = StepScheduler(FakeEngine(cached={2: 16}), 40, chunk_size=32, clock=clock)
    s.submit(Request(prompt(1, 50), max_new_tokens=4, priority=0))
    s.submit(Request(prompt(2, 20), max_new_tokens=2, priority=3))
    view = s.view
    assert [(p.priority, p.remaining, p.position, p.decode_tokens) for p in view.prefills] == [(0, 50, 0, 3),
                                                                                              (3, 4, 16, 1)]
    assert view.decoding == () and view.step_ends_at is None
    s.step()  # 32 tokens of prompt 1; prompt 2, of a worse priority, shares no step with it
    assert [(p.priority, p.remaining, p.position) for p in s.view.prefills] == [(0, 18, 32), (3, 4, 16)]
    assert s.view.decoding == () and s.view.step_ends_at is None
    clock.now += 2.5  # prompt 1 is the best priority already; prompt 2 has waited 2.5 s
    s.submit(Request(prompt(3, 10), priority=2))
    clock.now += 1.0  # prompt 3 has waited 1 s: one level better; prompt 2 3.5 s: three
    s.submit(Request(prompt(4, 12), priority=5))
    assert [(p.priority, p.remaining) for p in s.view.prefills] == [(0, 18), (0, 4), (1, 10), (5, 12)]
    s.cancel(0)  # prompt 1: now prompt 3's priority is the best there is, and none ages past it
    assert [(p.priority, p.remaining) for p in s.view.prefills] == [(2, 4), (2, 10), (5, 12)]
    s.step()  # prompts 2 and 3 tie: both run; prompt 4 is worse and waits
    # A running sequence is seen with its own priority (aging is for waiting prefills): prompt 2 decodes once more.
    assert s.view.decoding == (QueuedDecode(3, 1),)
    assert [(p.priority, p.remaining) for p in s.view.prefills] == [(5, 12)]


def test_a_steps_time_outside_its_forwards_is_tracked_and_replayed_per_step():
    model = exact_model()
    for _ in range(200):
        model.observe_step(total_s=0.030, forwards_s=0.020)  # 10 ms per step beyond the forwards
    assert model.step_overhead_s == pytest.approx(0.010, rel=1e-3)
    assert model.coefficients()["overhead_s"] == model.step_overhead_s
    shape = StepShape(token_budget=64, chunk_size=32, min_chunk=8)
    estimate = simulate(model, QueueView(decoding=(QueuedDecode(0, 5),)), shape, QueuedPrefill(0, 64, 0, 0), now=0.0)
    # Two steps (32 tokens each, beside one decode): each pays its overhead once.
    assert estimate.ttft_s == pytest.approx(2 * (0.010 + true_decode(1)) + true_prefill(32, 0) + true_prefill(32, 32),
                                            rel=1e-4)
