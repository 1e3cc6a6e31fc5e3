"""Multi-turn sessions reuse earlier turns' KV; the step scheduler interleaves chunks and decodes correctly."""

import pytest
import torch

from tests.helpers import assert_logits_match
from ttftc import zoo
from ttftc.runtime import ChatSession, PrefillEngine, PrefixCache, Request, StepScheduler
from ttftc.runtime.workloads import TimedRequest, run_arrivals


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


def test_short_prompt_is_not_stuck_behind_a_long_one_and_long_is_not_starved():
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    scheduler = StepScheduler(engine, token_budget=24, chunk_size=16, max_skipped_steps=2)
    scheduler.submit(Request(zoo.example_ids(model, 64)[0].tolist(), request_id="long"))
    scheduler.step()  # the long prompt starts
    scheduler.submit(Request(zoo.example_ids(model, 6, seed=2)[0].tolist(), request_id="short"))
    scheduler.step()
    assert scheduler.records["short"].finished  # served first in the next step, not after the whole long prompt
    for k in range(3):  # a stream of short prompts cannot hold the long one back for more than 2 steps
        scheduler.submit(Request(zoo.example_ids(model, 20, seed=3 + k)[0].tolist(), request_id=f"s{k}"))
    scheduler.run_until_idle()
    assert all(r.finished for r in scheduler.records.values())
