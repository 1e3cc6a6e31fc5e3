"""Multi-turn sessions reuse earlier turns' KV; the step scheduler interleaves chunks and decodes correctly."""

import time

import pytest
import torch

from tests.helpers import assert_logits_match
from ttftc import zoo
from ttftc.runtime import ChatSession, PrefillEngine, PrefixCache, Request, StepScheduler
from ttftc.bench.runtime_workloads import TimedRequest, run_arrivals


def reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_turn_n_reuses_earlier_turns(family):
    model = zoo.build(family, "sdpa")
    engine = PrefillEngine(model, prefix_cache=PrefixCache(1 << 24, block_size=4), chunk_size=5)
    turns = [zoo.example_ids(model, n, seed=s)[0].tolist() for s, n in ((1, 9), (2, 6), (3, 7))]
    with ChatSession(engine, tenant="u") as session:
        for i, turn in enumerate(turns):
            before = len(session.history)
            result = session.send(turn, max_new_tokens=3)
            # Earlier turns (prompts and replies) came from KV; only this turn and the last reply token were computed.
            unfed = 1 if i else 0
            assert result.cached_tokens == before - unfed
            assert result.computed_tokens == len(turn) + unfed
            prompt = session.history[:before + len(turn)]
            assert_logits_match(result.first.logits, reference_logits(model, prompt))
        history = session.history
    # A new session replaying the same history starts warm from the prefix cache.
    replay = engine.first_token(history, tenant="u")
    assert replay.cached_tokens >= len(history) - 4 - 1
    replay.kv.release()


def test_send_decodes_a_reply_and_continues():
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    a, b = (zoo.example_ids(model, n, seed=s)[0].tolist() for s, n in ((1, 8), (2, 5)))
    with ChatSession(engine) as session:
        t1 = session.send(a, max_new_tokens=4)
        t2 = session.send(b, max_new_tokens=2)
        assert len(t1.reply) == 4 and t2.cached_tokens == len(a) + 3
        full = a + t1.reply + b
        assert_logits_match(t2.first.logits, reference_logits(model, full))
    with pytest.raises(ValueError, match="closed"):
        session.prefill(b)


def test_scheduler_matches_serial_results_and_respects_budget():
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    prompts = [zoo.example_ids(model, n, seed=s)[0].tolist() for s, n in ((1, 40), (2, 6), (3, 9))]
    expected = []
    for p in prompts:
        first = engine.first_token(p)
        expected.append(engine.generate(first, 3))
        first.kv.release()

    scheduler = StepScheduler(engine, token_budget=12, chunk_size=8)
    for i, p in enumerate(prompts):
        scheduler.submit(Request(p, max_new_tokens=3, request_id=i))
    steps = []
    while not scheduler.idle:
        steps.append(scheduler.step())
    assert all(s.decode_tokens + s.prefill_tokens <= 12 for s in steps)
    # The long prompt needed several chunks, and the short ones got budget in the same steps.
    assert any(s.decode_tokens and s.prefill_tokens for s in steps)
    for i, tokens in enumerate(expected):
        record = scheduler.records[i]
        assert record.finished and record.tokens == tokens and record.ttft is not None


def test_unchunked_scheduler_prefills_whole_prompts():
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    scheduler = StepScheduler(engine, token_budget=8, chunk_size=None)
    scheduler.submit(Request(zoo.example_ids(model, 30)[0].tolist()))
    stats = scheduler.step()
    assert stats.prefill_tokens == 30 and scheduler.idle  # the first prefill of a step always runs whole


def test_arrivals_with_background_decoder_and_cancel():
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    ids = [zoo.example_ids(model, n, seed=s)[0].tolist() for s, n in ((1, 5), (2, 50), (3, 5))]
    timed = [TimedRequest(0.0, Request(ids[0], request_id="a")), TimedRequest(0.001, Request(ids[1], request_id="b")),
             TimedRequest(0.002, Request(ids[2], request_id="c"))]
    records, background = run_arrivals(engine, timed, token_budget=20, chunk_size=16,
                                       background=Request(ids[0], max_new_tokens=1 << 20, request_id="bg"))
    assert [r.request_id for r in records] == ["a", "b", "c"]
    assert all(r.finished and r.ttft >= 0 for r in records)
    assert background.cancelled and len(background.tokens) > 1 and background.max_token_gap > 0


def _prefill_progress(scheduler, request_id) -> int:
    """Tokens of `request_id`'s prompt already in its KV (the whole prompt once it left the prefill queue)."""
    for item in scheduler._prefilling:
        if item.request.request_id == request_id:
            return item.job.position
    return scheduler.records[request_id].prompt_tokens


def test_short_prompt_is_not_stuck_behind_a_long_one_and_long_is_not_starved():
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    max_skipped = 2
    scheduler = StepScheduler(engine, token_budget=24, chunk_size=16, max_skipped_steps=max_skipped)
    scheduler.submit(Request(zoo.example_ids(model, 64)[0].tolist(), request_id="long"))
    scheduler.step()  # the long prompt starts
    scheduler.submit(Request(zoo.example_ids(model, 6, seed=2)[0].tolist(), request_id="short"))
    scheduler.step()
    assert scheduler.records["short"].finished  # served first in the next step, not after the whole long prompt
    # A 12-token prompt arrives at every step. Shortest-first serves it before the long prompt, whose 16-token
    # chunk then no longer fits the 12 tokens of budget left: without the anti-starvation rule the long prompt
    # would get nothing for as long as the stream lasts. With it, it waits at most `max_skipped` steps in a row.
    skipped_in_a_row, worst, steps = 0, 0, 0
    while not scheduler.records["long"].finished:
        assert steps < 40, "the long prompt never finished under a steady stream of short prompts"
        scheduler.submit(Request(zoo.example_ids(model, 12, seed=100 + steps)[0].tolist(), request_id=f"s{steps}"))
        before = _prefill_progress(scheduler, "long")
        scheduler.step()
        steps += 1
        skipped_in_a_row = skipped_in_a_row + 1 if _prefill_progress(scheduler, "long") == before else 0
        worst = max(worst, skipped_in_a_row)
    assert worst == max_skipped  # the stream did hold it back, and exactly as long as the bound allows
    scheduler.run_until_idle()
    assert all(r.finished for r in scheduler.records.values())


# ---- batching window, slots, batched prefill, failures -------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_batching_window_holds_new_prefills_until_it_closes_or_the_budget_fills():
    model = zoo.build("llama")
    clock = FakeClock()
    scheduler = StepScheduler(PrefillEngine(model), token_budget=64, batch_window_s=0.010, clock=clock)
    scheduler.submit(Request(zoo.example_ids(model, 6)[0].tolist(), max_new_tokens=2, request_id="a"))
    clock.now = 0.004
    scheduler.submit(Request(zoo.example_ids(model, 7, seed=2)[0].tolist(), max_new_tokens=2, request_id="b"))
    assert scheduler.next_step_at() == pytest.approx(0.010)  # the earliest arrival's window
    assert scheduler.step().prefill_tokens == 0 and scheduler.num_waiting == 2
    clock.now = 0.010
    stats = scheduler.step()
    assert stats.prefill_tokens == 13 and {rid for rid, _ in stats.emitted} == {"a", "b"}
    assert scheduler.records["a"].queue_time == pytest.approx(0.010)
    assert scheduler.records["b"].queue_time == pytest.approx(0.006)
    # Enough waiting tokens to fill a step's budget: no need to wait for the window.
    scheduler.submit(Request(zoo.example_ids(model, 70, seed=3)[0].tolist(), request_id="big"))
    assert scheduler.next_step_at() == clock.now
    scheduler.run_until_idle()
    assert all(r.finished for r in scheduler.records.values())


def test_slots_bound_the_requests_in_flight_and_a_cancel_frees_one():
    model = zoo.build("llama")
    scheduler = StepScheduler(PrefillEngine(model), token_budget=64, max_running=1)
    scheduler.submit(Request(zoo.example_ids(model, 5)[0].tolist(), max_new_tokens=1000, request_id="long"))
    scheduler.submit(Request(zoo.example_ids(model, 5, seed=2)[0].tolist(), max_new_tokens=2, request_id="next"))
    for _ in range(3):
        scheduler.step()
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    assert scheduler.kv_tokens > 5 and scheduler.records["next"].prefill_started_at is None
    record = scheduler.cancel("long")
    assert record.cancelled and record.finish_reason == "cancelled"
    scheduler.run_until_idle()
    assert scheduler.records["next"].finished and scheduler.kv_tokens == 0
    assert scheduler.forget("next").finish_reason == "length" and "next" not in scheduler.records


def test_cold_prompts_of_one_step_prefill_together_with_the_serial_results():
    from ttftc.bucketed import compile_bucketed
    import ttftc

    model = zoo.build("llama", "sdpa")
    bucketed = compile_bucketed(model, ttftc.Config(buckets=(16,)), cache=None)
    prompts = [zoo.example_ids(model, n, seed=n)[0].tolist() for n in (4, 11, 16, 40)]
    serial = []
    for p in prompts:
        engine = PrefillEngine(model)
        first = engine.first_token(p)
        serial.append(engine.generate(first, 3))
        first.kv.release()
    engine = PrefillEngine(model, prefill_model=bucketed, prefill_batch_sizes=(1, 2, 4))
    scheduler = StepScheduler(engine, token_budget=128, chunk_size=16)
    for i, p in enumerate(prompts):
        scheduler.submit(Request(p, max_new_tokens=3, request_id=i))
    first_step = scheduler.step()
    assert first_step.batched_rows == 4  # three short prompts and the long one's first chunk, one forward
    assert {rid for rid, _ in first_step.emitted} == {0, 1, 2}
    scheduler.run_until_idle()
    assert [scheduler.records[i].tokens for i in range(4)] == serial


def test_stop_tokens_and_a_failing_request_do_not_stop_the_others(monkeypatch):
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    ids = zoo.example_ids(model, 6)[0].tolist()
    probe = engine.first_token(ids)
    probe.kv.release()
    scheduler = StepScheduler(engine, token_budget=64)
    scheduler.submit(Request(ids, max_new_tokens=10, stop_token_ids=(probe.token,), request_id="stops"))
    poison = zoo.example_ids(model, 9, seed=5)[0].tolist()
    scheduler.submit(Request(poison, max_new_tokens=3, request_id="fails"))
    scheduler.submit(Request(zoo.example_ids(model, 7, seed=6)[0].tolist(), max_new_tokens=3, request_id="fine"))
    real_forward = engine._forward

    def forward(tokens, kv, start):
        if list(tokens) == poison:
            raise RuntimeError("injected failure")
        return real_forward(tokens, kv, start)

    monkeypatch.setattr(engine, "_forward", forward)
    scheduler.run_until_idle()
    records = scheduler.records
    assert records["stops"].finish_reason == "stop" and records["stops"].tokens == [probe.token]
    assert records["fails"].finish_reason == "error" and "injected failure" in records["fails"].error
    assert records["fine"].finish_reason == "length" and len(records["fine"].tokens) == 3


def test_engine_loop_streams_cancels_and_drains():
    import threading

    from ttftc.runtime import EndEvent, EngineClosedError, EngineLoop, TokenEvent

    model = zoo.build("llama")
    loop = EngineLoop(StepScheduler(PrefillEngine(model), token_budget=64)).start()
    events: dict = {}
    ended = threading.Event()

    def sink(event):
        events.setdefault(event.request_id, []).append(event)
        if isinstance(event, EndEvent) and event.request_id == "short":
            ended.set()

    ids = zoo.example_ids(model, 6)[0].tolist()
    with pytest.raises(ValueError, match="vocabulary"):
        loop.submit(Request([1, 10_000]), sink)  # refused in the caller's thread, never queued
    loop.submit(Request(ids, max_new_tokens=1 << 20, request_id="endless"), sink)
    loop.submit(Request(ids, max_new_tokens=4, request_id="short"), sink)
    assert ended.wait(30)
    tokens = [e for e in events["short"] if isinstance(e, TokenEvent)]
    assert [e.index for e in tokens] == [0, 1, 2, 3] and events["short"][-1].reason == "length"
    loop.cancel("endless")
    loop.cancel("no-such-request")  # a late cancel of a finished or unknown request is harmless
    deadline = time.monotonic() + 30
    while not isinstance(events["endless"][-1], EndEvent) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events["endless"][-1].reason == "cancelled"
    loop.submit(Request(ids, max_new_tokens=1 << 20, request_id="cut"), sink)
    assert loop.close(drain_timeout_s=0.2) == 1  # never finishes on its own: cut off at the drain timeout
    assert events["cut"][-1].reason == "cancelled"
    with pytest.raises(EngineClosedError):
        loop.submit(Request(ids), sink)


# ---- cancel mid-prefill, eos, failures releasing what they hold ------------------------------------------------------


def _cache_with_prefix(model, prompt, n_cached):
    """An engine whose prefix cache holds the first `n_cached` tokens of `prompt` for tenant "t" (no lease left)."""
    cache = PrefixCache(1 << 24, block_size=8)
    engine = PrefillEngine(model, prefix_cache=cache)
    engine.first_token(prompt[:n_cached] + [1], tenant="t").kv.release()
    assert cache.stats().blocks_held == n_cached // 8
    return engine, cache


def _unleased(cache) -> bool:
    """Every block of the cache is free to evict: no lease (and no KV handle) still holds one."""
    cache.clear()
    return cache.stats().blocks_held == 0


def test_cancelling_a_request_mid_prefill_frees_its_kv_and_its_cache_lease():
    model = zoo.build("llama")
    prompt = zoo.example_ids(model, 60)[0].tolist()
    engine, cache = _cache_with_prefix(model, prompt, 24)
    scheduler = StepScheduler(engine, token_budget=8, chunk_size=8)
    record = scheduler.submit(Request(prompt, max_new_tokens=4, tenant="t", request_id="long"))
    assert record.cached_tokens == 24  # the job holds a lease on the 3 cached blocks
    scheduler.step()
    scheduler.step()
    assert record.prefill_started_at is not None and not record.done
    assert scheduler.kv_tokens == 24 + 16 and not _unleased(cache)
    assert scheduler.cancel("long") is record
    assert record.cancelled and record.finish_reason == "cancelled" and record.tokens == []
    assert scheduler.idle and scheduler.kv_tokens == 0
    assert _unleased(cache)
    with pytest.raises(KeyError):
        scheduler.cancel("long")


def test_a_request_stops_at_its_eos_token():
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    ids = zoo.example_ids(model, 7, seed=4)[0].tolist()
    first = engine.first_token(ids)
    greedy = engine.generate(first, 8)
    first.kv.release()
    eos = next(t for t in greedy if t != greedy[0])  # a token that is not the first one
    expected = greedy[:greedy.index(eos) + 1]
    assert len(expected) >= 2 and len(expected) < 8
    first = engine.first_token(ids)
    assert engine.generate(first, 8, eos_token_id=eos) == expected
    first.kv.release()
    scheduler = StepScheduler(engine, token_budget=64)
    scheduler.submit(Request(ids, max_new_tokens=8, eos_token_id=eos, request_id="eos"))
    scheduler.submit(Request(ids, max_new_tokens=8, request_id="no-eos"))
    scheduler.run_until_idle()
    assert scheduler.records["eos"].tokens == expected and scheduler.records["eos"].finish_reason == "stop"
    assert scheduler.records["no-eos"].tokens == greedy and scheduler.records["no-eos"].finish_reason == "length"


def test_a_failed_prefill_forward_releases_its_job_and_its_cache_lease(monkeypatch):
    model = zoo.build("llama")
    prompt = zoo.example_ids(model, 40)[0].tolist()
    engine, cache = _cache_with_prefix(model, prompt, 16)
    real_forward = engine._forward
    failures = []

    def forward(tokens, kv, start):
        if start >= 24:  # the second chunk of the prompt that hit the cache
            failures.append(start)
            raise RuntimeError("injected failure")
        return real_forward(tokens, kv, start)

    monkeypatch.setattr(engine, "_forward", forward)
    scheduler = StepScheduler(engine, token_budget=8, chunk_size=8)
    scheduler.submit(Request(prompt, max_new_tokens=2, tenant="t", request_id="fails"))
    scheduler.submit(Request(prompt[:5], max_new_tokens=2, tenant="u", request_id="fine"))
    scheduler.run_until_idle()
    record = scheduler.records["fails"]
    assert failures and record.finish_reason == "error" and "injected failure" in record.error
    assert record.cached_tokens == 16 and record.tokens == []
    assert scheduler.records["fine"].finish_reason == "length"
    assert scheduler.kv_tokens == 0 and _unleased(cache)
