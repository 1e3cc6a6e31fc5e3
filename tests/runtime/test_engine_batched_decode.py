"""Batched decode: one forward for several requests whose KV differ in length gives the tokens of decoding each
alone (greedy and seeded sampling), isolates a bad row, undoes a failed forward, and falls back for models it does
not cover."""

import pytest
import torch

from ttftc import zoo
from ttftc.runtime import PrefillEngine, Sampling
from ttftc.runtime.kv import RaggedDecodeCache, RaggedDecodeUnsupported
from ttftc.runtime.sampling import GREEDY


def prompts(model, lengths):
    vocab = model.config.vocab_size
    return [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def serial(engine, ids, steps, sampling=GREEDY):
    first = engine.first_token(ids, sampling=sampling)
    generator = sampling.generator()
    tokens, logits = [first.token], []
    for _ in range(steps):
        token, row = engine.decode_step(first.kv, tokens[-1], sampling, generator)
        tokens.append(token)
        logits.append(row)
    first.kv.release()
    return tokens, logits


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}), ("gpt2", {}), ("qwen2", {}), ("phi3", {}), ("gemma", {}),
    ("mistral", {"sliding_window": 8}),  # rows past their window, rows within it
])
def test_batched_greedy_decode_equals_decoding_each_request_alone(family, overrides):
    model = zoo.build(family, **overrides)
    engine = PrefillEngine(model)
    batch = prompts(model, (15, 3, 40, 7))
    expected = [serial(engine, ids, 6) for ids in batch]
    firsts = [engine.first_token(ids) for ids in batch]
    tokens = [[first.token] for first in firsts]
    calls = []
    real = engine._forward_ragged
    engine._forward_ragged = lambda handles, toks: calls.append(len(handles)) or real(handles, toks)
    for _ in range(6):
        out = engine.decode_batch([(f.kv, t[-1], GREEDY, None) for f, t in zip(firsts, tokens)])
        for t, token in zip(tokens, out):
            assert isinstance(token, int)
            t.append(token)
    assert calls == [4] * 6 and engine.batched_decode  # one forward per step, for all four
    assert tokens == [t for t, _ in expected]
    assert [f.kv.seq_len for f in firsts] == [n + 6 for n in (15, 3, 40, 7)]
    for f in firsts:
        f.kv.release()


def test_batched_logits_match_and_seeded_sampling_keeps_each_requests_stream():
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    batch = prompts(model, (9, 21))
    samplings = [Sampling(temperature=1.0, seed=5), Sampling(temperature=0.8, top_k=20, seed=6)]
    expected = [serial(engine, ids, 5, s)[0] for ids, s in zip(batch, samplings)]
    firsts = [engine.first_token(ids, sampling=s) for ids, s in zip(batch, samplings)]
    generators = [s.generator() for s in samplings]
    tokens = [[f.token] for f in firsts]
    for _ in range(5):
        out = engine.decode_batch([(f.kv, t[-1], s, g) for f, t, s, g in zip(firsts, tokens, samplings, generators)])
        for t, token in zip(tokens, out):
            t.append(token)
    assert tokens == expected
    # The logits themselves, against one forward per request.
    a, b = (engine.first_token(ids) for ids in batch)
    logits = engine._forward_ragged([a.kv, b.kv], [a.token, b.token])
    _, ref_a = serial(engine, batch[0], 1)
    _, ref_b = serial(engine, batch[1], 1)
    torch.testing.assert_close(logits[0], ref_a[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], ref_b[0], rtol=1e-4, atol=1e-4)
    for f in firsts + [a, b]:
        f.kv.release()


def test_a_bad_row_gets_its_error_and_the_others_decode():
    model = zoo.build("llama", max_position_embeddings=32)
    engine = PrefillEngine(model)
    ok1, full, ok2, gone = (engine.first_token(ids) for ids in prompts(model, (5, 32 - 1, 6, 4)))
    gone.kv.release()
    full.kv.token_ids.append(full.token)  # fake a handle with no position left
    out = engine.decode_batch([(ok1.kv, ok1.token, GREEDY, None), (full.kv, 3, GREEDY, None),
                               (ok2.kv, ok2.token, GREEDY, None), (gone.kv, 1, GREEDY, None),
                               (ok2.kv, 10**9, GREEDY, None)])
    assert isinstance(out[0], int) and isinstance(out[2], int)
    assert isinstance(out[1], ValueError) and "exceed" in str(out[1])
    assert isinstance(out[3], ValueError) and "released" in str(out[3])
    assert isinstance(out[4], ValueError) and "vocabulary" in str(out[4])
    assert ok1.kv.seq_len == 6 and ok2.kv.seq_len == 7


def test_a_forward_that_fails_halfway_is_undone_and_its_rows_decode_alone(monkeypatch):
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    batch = prompts(model, (5, 12))
    expected = [serial(engine, ids, 2)[0] for ids in batch]
    firsts = [engine.first_token(ids) for ids in batch]
    real_update = RaggedDecodeCache.update
    calls = {"n": 0}

    def failing_update(self, k, v, layer_idx, *args, **kwargs):
        calls["n"] += 1
        if layer_idx == 1:  # layer 0 already appended its token to both rows
            raise RuntimeError("injected failure mid-forward")
        return real_update(self, k, v, layer_idx, *args, **kwargs)

    monkeypatch.setattr(RaggedDecodeCache, "update", failing_update)
    out = engine.decode_batch([(f.kv, f.token, GREEDY, None) for f in firsts])
    assert calls["n"] == 2 and engine.batched_decode  # a failure, not a model it cannot run: stays on
    # Undone, then each row decoded alone: the same tokens as serial decoding, KV one token longer.
    assert out == [e[1] for e in expected]
    assert [f.kv.seq_len for f in firsts] == [6, 13]
    for f in firsts:
        assert all(layer.keys.shape[-2] == f.kv.seq_len for layer in f.kv.cache.layers)
    monkeypatch.setattr(RaggedDecodeCache, "update", real_update)
    out2 = engine.decode_batch([(f.kv, t, GREEDY, None) for f, t in zip(firsts, out)])
    assert out2 == [e[2] for e in expected]


def test_a_model_outside_the_ragged_forward_switches_batched_decode_off(monkeypatch):
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    batch = prompts(model, (5, 12))
    expected = [serial(engine, ids, 1)[0] for ids in batch]
    firsts = [engine.first_token(ids) for ids in batch]

    def unsupported(*args, **kwargs):
        raise RaggedDecodeUnsupported("soft-capping")

    monkeypatch.setattr(engine, "_forward_ragged", unsupported)
    assert engine.decode_batch([(f.kv, f.token, GREEDY, None) for f in firsts]) == [e[1] for e in expected]
    assert not engine.batched_decode
    assert model.config._attn_implementation == "eager"


def test_the_attention_setting_is_restored_and_one_row_takes_the_plain_path(monkeypatch):
    model = zoo.build("llama", "sdpa")
    engine = PrefillEngine(model)
    (first,) = (engine.first_token(ids) for ids in prompts(model, (7,)))
    monkeypatch.setattr(engine, "_forward_ragged", lambda *a: pytest.fail("one row needs no ragged forward"))
    assert isinstance(engine.decode_batch([(first.kv, first.token, GREEDY, None)])[0], int)
    monkeypatch.undo()
    other = engine.first_token(prompts(model, (9,))[0])
    engine.decode_batch([(first.kv, 1, GREEDY, None), (other.kv, 2, GREEDY, None)])
    assert model.config._attn_implementation == "sdpa"
    off = PrefillEngine(model, batched_decode=False)
    monkeypatch.setattr(off, "_forward_ragged", lambda *a: pytest.fail("batched decode is off"))
    assert all(isinstance(t, int) for t in off.decode_batch([(first.kv, 1, GREEDY, None), (other.kv, 2, GREEDY, None)]))
