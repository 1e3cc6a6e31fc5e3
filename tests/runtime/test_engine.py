"""PrefillEngine: chunked == monolithic, cached == uncached, decode continuation, compiled models, bad input."""

import gc

import pytest
import torch

import ttftc
from tests.helpers import assert_logits_match, zoo_cases
from ttftc import zoo
from ttftc.runtime import LeaseReleasedError, PrefillEngine, PrefixCache, Sampling

PROMPT = 37  # not a multiple of the block or chunk size: partial blocks and ragged last chunks on purpose


def reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.fixture(scope="module")
def models():
    return {case: zoo.build(*case) for case in zoo_cases()}


@pytest.mark.parametrize("case", zoo_cases(), ids=lambda c: "-".join(c))
def test_chunked_and_cached_logits_match_monolithic(models, case):
    model = models[case]
    ids = zoo.example_ids(model, PROMPT)[0].tolist()
    expected = reference_logits(model, ids)

    monolithic = PrefillEngine(model).first_token(ids)
    assert_logits_match(monolithic.logits, expected)
    assert (monolithic.cached_tokens, monolithic.computed_tokens) == (0, PROMPT)

    chunked = PrefillEngine(model, chunk_size=5).first_token(ids)
    assert_logits_match(chunked.logits, expected)

    cache = PrefixCache(1 << 24, block_size=8)
    engine = PrefillEngine(model, prefix_cache=cache, chunk_size=6)
    engine.first_token(ids[:20] + [1] * 10, tenant="t").kv.release()  # caches 2 blocks of the shared 20 tokens
    warm = engine.first_token(ids, tenant="t")
    assert warm.cached_tokens == 16 and warm.computed_tokens == PROMPT - 16
    assert_logits_match(warm.logits, expected)
    full = engine.first_token(ids, tenant="t")  # the whole prompt is cached now, but its last token is computed
    assert full.cached_tokens == 32 and full.computed_tokens == PROMPT - 32
    assert_logits_match(full.logits, expected)
    assert warm.token == full.token == monolithic.token == int(expected.argmax())
    for f in (monolithic, chunked, warm, full):
        f.kv.release()


def test_cache_never_serves_the_last_token():
    model = zoo.build("llama")
    ids = zoo.example_ids(model, 16)[0].tolist()  # exactly two blocks of 8
    engine = PrefillEngine(model, prefix_cache=PrefixCache(1 << 24, block_size=8))
    engine.first_token(ids, tenant="t").kv.release()
    again = engine.first_token(ids, tenant="t")
    assert again.cached_tokens == 8 and again.computed_tokens == 8  # a whole block recomputed for the logits
    assert_logits_match(again.logits, reference_logits(model, ids))


@pytest.mark.parametrize("family", zoo.CORE_FAMILIES)
def test_decode_continues_like_plain_generate(family):
    model = zoo.build(family, "sdpa")
    ids = zoo.example_ids(model, 21)[0].tolist()
    with torch.no_grad():
        plain = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    engine = PrefillEngine(model, prefix_cache=PrefixCache(1 << 24, block_size=4), chunk_size=8)
    engine.first_token(ids, tenant="t").kv.release()

    ours = engine.first_token(ids, tenant="t")
    assert ours.cached_tokens == 20
    assert engine.generate(ours, 6) == plain
    ours.kv.release()

    via_hf = engine.first_token(ids, tenant="t")
    with torch.no_grad():
        out = model.generate(**via_hf.kv.generate_inputs(via_hf.token), max_new_tokens=5, do_sample=False)
    assert [via_hf.token] + out[0, len(ids) + 1:].tolist() == plain
    via_hf.kv.release()


def test_chunks_bound_activations():
    model = zoo.build("llama")
    seen = []
    hooks = [layer.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1])) for layer in model.model.layers]
    try:
        ids = zoo.example_ids(model, 30)[0].tolist()
        PrefillEngine(model, chunk_size=4).first_token(ids).kv.release()
    finally:
        for h in hooks:
            h.remove()
    assert seen and max(seen) <= 4 and sum(seen) == 30 * len(model.model.layers)


def test_sliding_window_longer_than_window_is_not_cached_but_correct():
    model = zoo.build("mistral", "eager", sliding_window=8)
    ids = zoo.example_ids(model, 20)[0].tolist()
    cache = PrefixCache(1 << 24, block_size=4)
    engine = PrefillEngine(model, prefix_cache=cache, chunk_size=6)
    first = engine.first_token(ids, tenant="t")
    assert_logits_match(first.logits, reference_logits(model, ids))
    assert cache.stats().blocks_held == 0  # the window dropped old KV: nothing honest to cache
    first.kv.release()


def test_ttftc_compiled_model_runs_in_the_engine():
    model = zoo.build("llama", "sdpa")
    compiled = torch.compile(model, backend=ttftc.TtftcBackend())
    ids = zoo.example_ids(model, 23)[0].tolist()
    expected = reference_logits(model, ids)
    engine = PrefillEngine(compiled, prefix_cache=PrefixCache(1 << 24, block_size=8), chunk_size=8)
    cold = engine.first_token(ids, tenant="t")
    warm = engine.first_token(ids, tenant="t")
    assert warm.cached_tokens == 16
    for f in (cold, warm):
        assert_logits_match(f.logits, expected)
    with torch.no_grad():
        plain = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    assert engine.generate(warm, 4) == plain
    cold.kv.release()
    warm.kv.release()


def test_kv_handle_release_rules():
    model = zoo.build("llama")
    cache = PrefixCache(1 << 24, block_size=4)
    engine = PrefillEngine(model, prefix_cache=cache)
    ids = zoo.example_ids(model, 12)[0].tolist()
    first = engine.first_token(ids, tenant="t")
    first.kv.release()
    with pytest.raises(LeaseReleasedError):
        first.kv.release()
    with pytest.raises(ValueError, match="released"):
        engine.decode_step(first.kv, first.token)
    assert cache.clear() > 0  # nothing stayed referenced

    forgotten = engine.first_token(ids, tenant="t")
    assert cache.clear() == 0  # referenced by the live handle
    del forgotten
    gc.collect()
    assert cache.clear() > 0  # the collected handle gave its lease back


def test_sampling_is_seeded_and_valid():
    model = zoo.build("llama")
    engine = PrefillEngine(model)
    ids = zoo.example_ids(model, 9)[0].tolist()
    s = Sampling(temperature=0.8, top_k=5, seed=3)
    a = engine.first_token(ids, sampling=s)
    b = engine.first_token(ids, sampling=s)
    assert a.token == b.token and a.token in torch.topk(a.logits, 5).indices.tolist()
    with pytest.raises(ValueError):
        Sampling(temperature=-1.0)


def test_bad_input_is_a_clear_value_error():
    model = zoo.build("llama")  # vocab 256, 512 positions
    engine = PrefillEngine(model)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.first_token([])
    with pytest.raises(ValueError, match="empty prompt"):
        engine.first_token(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="maximum of 512"):
        engine.first_token([1] * 513)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.first_token([1, 256])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.first_token([-1, 2])
    with pytest.raises(ValueError, match="batch"):
        engine.first_token(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        engine.first_token(torch.ones(1, 4))
    with pytest.raises(ValueError, match="chunk_size"):
        PrefillEngine(model, chunk_size=0)
    with pytest.raises(ValueError, match="cannot hold one block"):
        PrefillEngine(model, prefix_cache=PrefixCache(100, block_size=16))
    first = engine.first_token([1] * 500)
    with pytest.raises(ValueError, match="already in the KV"):
        engine.extend(first.kv, [1] * 20)
    first.kv.release()


def test_a_failed_forward_gives_back_its_prefix_cache_lease(monkeypatch):
    model = zoo.build("llama")
    cache = PrefixCache(1 << 24, block_size=8)
    engine = PrefillEngine(model, prefix_cache=cache, chunk_size=8)
    ids = zoo.example_ids(model, 30)[0].tolist()
    engine.first_token(ids[:16] + [1], tenant="t").kv.release()
    real_forward = engine._forward

    def forward(tokens, kv, start):
        if start >= 24:
            raise RuntimeError("injected failure")
        return real_forward(tokens, kv, start)

    monkeypatch.setattr(engine, "_forward", forward)
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.first_token(ids, tenant="t")  # served 16 tokens from the cache, then failed on its second chunk
    cache.clear()
    assert cache.stats().blocks_held == 0, "the failed prefill still holds its lease on the cached blocks"


def test_one_cache_serves_one_model():
    cache = PrefixCache(1 << 24)
    first = zoo.build("llama")  # kept alive: the cache holds its model weakly, and a dead model frees the binding
    PrefillEngine(first, prefix_cache=cache)
    with pytest.raises(ValueError, match="another model"):
        PrefillEngine(zoo.build("llama", seed=1), prefix_cache=cache)


# ---- the bucketed path: cold prompts in shared padded forwards --------------------------------------------------


class CountingPrefill:
    """A bucketed model that records the shape of every batch it runs."""

    def __init__(self, bucketed):
        self.bucketed = bucketed
        self.plan, self.buckets = bucketed.plan, bucketed.buckets
        self.calls = []

    def __call__(self, ids, *args, **kwargs):
        self.calls.append(tuple(ids.shape))
        return self.bucketed(ids, *args, **kwargs)


@pytest.fixture(scope="module")
def bucketed_llama():
    from ttftc.bucketed import compile_bucketed

    model = zoo.build("llama", "sdpa")
    return model, compile_bucketed(model, ttftc.Config(buckets=(16, 32)), cache=None)


def test_cold_prompts_share_one_bucketed_forward_and_continue_on_the_kv_path(bucketed_llama):
    model, bucketed = bucketed_llama
    prefill = CountingPrefill(bucketed)
    engine = PrefillEngine(model, prefix_cache=PrefixCache(1 << 24, block_size=4), prefill_model=prefill,
                           prefill_batch_sizes=(1, 2))
    prompts = [zoo.example_ids(model, n, seed=n)[0].tolist() for n in (5, 12, 9)]
    jobs = [engine.start(p, tenant="t") for p in prompts]
    firsts = engine.prefill_together([(job, len(p)) for job, p in zip(jobs, prompts)])
    assert prefill.calls == [(2, 12), (1, 9)]  # one bucket, three prompts: a batch of 2 and a batch of 1
    for prompt, first in zip(prompts, firsts):
        assert_logits_match(first.logits, reference_logits(model, prompt))
        with torch.no_grad():
            plain = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):]
        assert engine.generate(first, 4) == plain.tolist()  # decode continues from the absorbed KV
        first.kv.release()
    # The bucketed prefill published its full blocks: the same tenant now hits them.
    warm = engine.first_token(prompts[1], tenant="t")
    assert warm.cached_tokens == 8 and engine.bucket_for(engine.start(prompts[1], tenant="t"), 4) is None
    assert_logits_match(warm.logits, reference_logits(model, prompts[1]))
    warm.kv.release()


def test_a_long_prompt_runs_its_first_chunk_bucketed_and_the_rest_on_the_kv_path(bucketed_llama):
    model, bucketed = bucketed_llama
    ids = zoo.example_ids(model, 45)[0].tolist()  # longer than the largest bucket (32)
    prefill = CountingPrefill(bucketed)
    engine = PrefillEngine(model, chunk_size=16, prefill_model=prefill)
    job = engine.start(ids)
    assert engine.bucket_for(job, 16) == 16
    assert engine.bucket_for(job, 45) is None  # no bucket holds the whole prompt
    first = engine.first_token(ids)
    assert prefill.calls == [(1, 16)]  # the first chunk only; chunks 2 and 3 continued from its KV
    assert (first.cached_tokens, first.computed_tokens) == (0, 45)
    assert_logits_match(first.logits, reference_logits(model, ids))
    first.kv.release()


def test_batch_sizes_and_the_padded_token_cap(bucketed_llama):
    model, bucketed = bucketed_llama
    engine = PrefillEngine(model, prefill_model=bucketed, prefill_batch_sizes=(4, 2, 1), prefill_batch_tokens=64)
    assert engine.batch_sizes_for(16) == (4, 2, 1) and engine.batch_sizes_for(32) == (2, 1)
    assert engine._split(list(range(7)), 16) == [[0, 1, 2, 3], [4, 5], [6]]
    assert engine._split(list(range(3)), 32) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="including 1"):
        PrefillEngine(model, prefill_model=bucketed, prefill_batch_sizes=(2, 4))
    warm = engine.start(zoo.example_ids(model, 8)[0].tolist())
    warm.advance(4)
    with pytest.raises(ValueError, match="cold jobs"):
        engine.prefill_together([(warm, 4)])  # KV already there: only the KV path can continue it


def test_chunk_table_picks_the_nearest_tuned_length():
    from ttftc.runtime import ChunkTable

    table = ChunkTable({256: None, 1024: 256})
    assert [table.for_tokens(n) for n in (100, 256, 257, 5000)] == [None, None, 256, 256]
    assert ChunkTable().for_tokens(10) is None
    model = zoo.build("llama")
    assert PrefillEngine(model, chunk_size=table).chunk_size_for(300) == 256
