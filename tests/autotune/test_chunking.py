"""Chunked prefill's chunk size as a tuned knob: the key, the search, the cache round trip, and the runtime using it."""

import argparse
import warnings

import pytest
import torch

import ttftc
from ttftc import zoo
from ttftc.autotune import cache as cache_module
from ttftc.autotune.cache import AutotuneCache
from ttftc.commands.autotune import _chunk_sizes
from ttftc.runtime import PrefillEngine
from ttftc.tuning.api import tune_model
from ttftc.tuning.chunking import (
    OP, chunk_candidates, chunk_key, pick_chunk_size, runner_of, tune_chunk_sizes, tuned_chunk_sizes, tuned_chunk_table,
)


@pytest.fixture(scope="module")
def model():
    return zoo.build("llama", "sdpa")


class FavourTimer:
    """Deterministic: runs the prefill (so it really executes) and scores it by chunk size alone."""

    def __init__(self, favourite):
        self.favourite, self.ran = favourite, []

    def __call__(self, fn, config):
        fn()
        self.ran.append(config["chunk_size"])
        return 1.0 if config["chunk_size"] == self.favourite else 3.0


def count_forwards(monkeypatch) -> list:
    sizes = []
    real = PrefillEngine._forward

    def spy(self, ids, kv_cache, start):
        sizes.append(len(ids))
        return real(self, ids, kv_cache, start)

    monkeypatch.setattr(PrefillEngine, "_forward", spy)
    return sizes


def test_candidates_are_the_whole_prompt_then_shorter_chunks():
    assert chunk_candidates(12, (32, 4, 8, 4)) == [None, 4, 8]
    assert chunk_candidates(4, (4, 8)) == [None]


def test_pick_uses_the_nearest_tuned_length_not_shorter_than_the_prompt():
    table = {512: 256, 2048: None}
    assert pick_chunk_size(table, 100) == 256
    assert pick_chunk_size(table, 512) == 256
    assert pick_chunk_size(table, 1000) is None
    assert pick_chunk_size({512: 256, 1024: 128}, 4096) == 128  # beyond every tuned length: the longest's
    assert pick_chunk_size({}, 100) is None


def test_runner_names_how_the_model_runs(model):
    assert runner_of(model) == "eager"
    fp32 = runner_of(torch.compile(model, backend=ttftc.backend(ttftc.Config(precision="fp32"))))
    bf16 = runner_of(torch.compile(model, backend=ttftc.backend(ttftc.Config(precision="bf16"))))
    assert fp32.startswith("ttftc-fp32:") and bf16.startswith("ttftc-bf16:")
    untuned = runner_of(torch.compile(model, backend=ttftc.backend(ttftc.Config(precision="fp32", autotune=False))))
    assert untuned != fp32
    assert runner_of(torch.compile(model, backend="eager")) == "compiled"


def test_key_depends_on_the_model_shapes_not_the_object(model):
    twin = zoo.build("llama", "sdpa", seed=3)
    wider = zoo.build("llama", "sdpa", hidden_size=128)
    assert chunk_key(twin, 64) == chunk_key(model, 64)
    assert chunk_key(wider, 64) != chunk_key(model, 64)
    assert chunk_key(model, 64) != chunk_key(model, 128)
    assert chunk_key(model, 64).op == OP


def test_tuned_chunk_size_round_trips_and_the_engine_uses_it(model, tmp_path, monkeypatch):
    cache = AutotuneCache(tmp_path)
    timer = FavourTimer(4)
    with torch.inference_mode():
        (result,) = tune_chunk_sizes(model, [12], (4, 8, 32), cache=cache, budget_s=60, timer=timer, progress=False)
    assert result.status == "tuned" and result.rejected == [], result.rejected
    assert result.config == {"chunk_size": 4}
    assert timer.ran == [None, 4, 8]  # the whole prompt (default) first; 32 is not shorter than the prompt
    assert result.default_ms == 3.0 and result.tuned_ms == 1.0
    assert tuned_chunk_sizes(model, AutotuneCache(tmp_path)) == {12: 4}

    ids = zoo.example_ids(model, 12)[0].tolist()
    whole = PrefillEngine(model).first_token(ids)
    sizes = count_forwards(monkeypatch)
    engine = PrefillEngine(model, chunk_size=tuned_chunk_table(model, AutotuneCache(tmp_path)))
    assert engine.chunk_size_for(12) == 4
    first = engine.first_token(ids)
    assert sizes == [4, 4, 4]
    assert first.token == whole.token
    torch.testing.assert_close(first.logits, whole.logits, atol=1e-4, rtol=1e-4)

    # The runtime never reads the autotune cache on its own (it is the lower layer): the caller hands it a size.
    assert PrefillEngine(model, chunk_size=6).chunk_size_for(12) == 6
    assert PrefillEngine(model).chunk_size_for(12) is None

    # Cached now: nothing is timed again.
    again = FavourTimer(8)
    with torch.inference_mode():
        (cached,) = tune_chunk_sizes(model, [12], (4, 8), cache=cache, budget_s=60, timer=again, progress=False)
    assert cached.status == "cached" and cached.config == {"chunk_size": 4} and again.ran == []


def test_the_default_cache_is_read_when_none_is_given(model, tmp_path, monkeypatch):
    monkeypatch.setenv("TTFTC_AUTOTUNE_CACHE", str(tmp_path))
    AutotuneCache(tmp_path).store(chunk_key(model, 64), {"chunk_size": 16}, 1.0, 2.0)
    assert tuned_chunk_table(model).sizes == {64: 16}
    other = zoo.build("llama", "sdpa", hidden_size=128)
    assert tuned_chunk_table(other).sizes == {}, "another model's entry must not apply"


def test_stale_entry_is_ignored_with_a_warning(model, tmp_path, monkeypatch):
    AutotuneCache(tmp_path).store(chunk_key(model, 64), {"chunk_size": 16}, 1.0, 2.0)
    monkeypatch.setattr(cache_module, "current_versions", lambda: {"ttftc": "9", "torch": "9", "triton": "9"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tuned_chunk_table(model, AutotuneCache(tmp_path)).sizes == {}
    assert len(caught) == 1 and "stale" in str(caught[0].message)


@pytest.mark.parametrize("chunk", [0, -16, 2.5, True, "16"])
def test_an_entry_with_a_chunk_size_no_prefill_can_take_is_skipped_with_a_warning(model, tmp_path, chunk):
    cache = AutotuneCache(tmp_path)
    cache.store(chunk_key(model, 64), {"chunk_size": chunk}, 1.0, 2.0)
    cache.store(chunk_key(model, 128), {"chunk_size": 32}, 1.0, 2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tuned_chunk_table(model, AutotuneCache(tmp_path)).sizes == {128: 32}
    assert len(caught) == 1 and f"chunk_size={chunk!r}, not a positive int or null" in str(caught[0].message)


def test_exhausted_budget_skips_and_bad_chunk_sizes_are_refused(model, tmp_path):
    cache = AutotuneCache(tmp_path)
    (skipped,) = tune_chunk_sizes(model, [12], (4,), cache=cache, budget_s=0, timer=FavourTimer(4), progress=False)
    assert skipped.status == "skipped: time budget used up"
    with pytest.raises(ValueError, match="chunk sizes"):
        tune_chunk_sizes(model, [12], (0,), cache=cache, budget_s=10, timer=FavourTimer(4), progress=False)
    with pytest.raises(ValueError, match="chunk sizes"):
        tune_model(model, [12], cache=cache, budget_s=10, chunk_sizes=(), progress=False)
    assert list(cache.entries()) == []
    with pytest.raises(argparse.ArgumentTypeError, match="--chunk-sizes"):
        _chunk_sizes("256,x")
    assert _chunk_sizes("512,256,512") == (256, 512)


class AnyTimer:
    """Runs each candidate once; kernel configs all score the same, chunk size 8 scores best."""

    def __call__(self, fn, config):
        fn()
        return 1.0 if config.get("chunk_size") == 8 else 2.0


def test_tune_model_tunes_chunks_of_the_compiled_model_and_its_engine_uses_them(model, tmp_path):
    cache = AutotuneCache(tmp_path)
    config = ttftc.Config(precision="fp32")
    results = tune_model(model, [16], config=config, cache=cache, budget_s=120, ops=("attention",), timer=AnyTimer(),
                         progress=False, chunk_sizes=(8,))
    chunked = [r for r in results if r.problem.op == OP]
    assert [(r.status, r.config, r.bucket) for r in chunked] == [("tuned", {"chunk_size": 8}, 16)]
    compiled = torch.compile(model, backend=ttftc.backend(config))
    assert PrefillEngine(compiled, chunk_size=tuned_chunk_table(compiled, cache)).chunk_size_for(16) == 8
    assert tuned_chunk_table(model, cache).for_tokens(16) is None, "the eager runner was not tuned"
