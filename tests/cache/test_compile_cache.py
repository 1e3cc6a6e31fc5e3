"""The compile cache: a second process compiles nothing; corrupted entries warn once and are rebuilt."""

import json
import threading
import warnings

import pytest
import torch

import ttftc
from tests.helpers import assert_logits_match, needs_transformers
from ttftc import zoo
from ttftc.buckets.compiled import CompiledGraphs
from ttftc.buckets.program import GraphSignature
from ttftc.cache import CompileCache, default_cache_dir
from ttftc.bucketed import compile_bucketed

pytestmark = needs_transformers
CONFIG = ttftc.Config(buckets=(16,))
SIGNATURE = GraphSignature(16, 1, "last", True)


def _first_run(root):
    """Compile one bucket of a tiny llama into the cache at `root`; returns (model, ids, expected last logits)."""
    model = zoo.build("llama", "sdpa")
    bucketed = compile_bucketed(model, CONFIG, cache=CompileCache(root))
    ids = zoo.example_ids(model, 10)
    expected = bucketed(ids, logits_to_keep=1).logits
    assert bucketed.source.compiles == 1
    return ids, expected


def _forbid_compiling(monkeypatch):
    """Make every compiler entry point fail: tracing, the padding analysis, passes and lowering."""
    def boom(*args, **kwargs):
        raise AssertionError("compiled on a cache hit")

    monkeypatch.setattr("ttftc.buckets.compiled.capture_graph", boom)
    monkeypatch.setattr("ttftc.buckets.compiled.analyse_padding", boom)
    monkeypatch.setattr("ttftc.passes.manager.PassManager.run", boom)
    monkeypatch.setattr("ttftc.codegen.lowering.lower_graph", boom)
    monkeypatch.setattr(torch, "compile", boom)


def test_second_process_compiles_nothing(tmp_path, monkeypatch):
    ids, expected = _first_run(tmp_path)
    # A "second process": a new model object (same code, config and weights) and a new cache object.
    _forbid_compiling(monkeypatch)
    model = zoo.build("llama", "sdpa")
    bucketed = compile_bucketed(model, CONFIG, cache=CompileCache(tmp_path))
    out = bucketed(ids, logits_to_keep=1)
    assert bucketed.source.compiles == 0 and bucketed.source.cache_hits == 1
    assert_logits_match(out.logits, expected)


def test_key_covers_config_weights_and_signature(tmp_path):
    cache = CompileCache(tmp_path)
    model = zoo.build("llama", "sdpa")
    device = torch.device("cpu")
    base = cache.graph_key(model, CONFIG, SIGNATURE, device)
    assert base == CompileCache(tmp_path).graph_key(zoo.build("llama", "sdpa"), CONFIG, SIGNATURE, device)
    assert base != cache.graph_key(model, CONFIG.replace(precision="bf16"), SIGNATURE, device)
    assert base != cache.graph_key(model, CONFIG.replace(passes=()), SIGNATURE, device)
    assert base != cache.graph_key(model, CONFIG, GraphSignature(32, 1, "last", True), device)
    other_weights = zoo.build("llama", "sdpa", seed=1)
    assert base != CompileCache(tmp_path).graph_key(other_weights, CONFIG, SIGNATURE, device)
    other_attn = zoo.build("llama", "eager")
    assert base != CompileCache(tmp_path).graph_key(other_attn, CONFIG, SIGNATURE, device)


def test_key_follows_the_autotune_cache_whose_configs_lowering_bakes_in(tmp_path, monkeypatch):
    from ttftc.autotune.cache import AutotuneCache, TuneKey

    monkeypatch.setenv("TTFTC_AUTOTUNE_CACHE", str(tmp_path / "tuned"))
    cache, model, device = CompileCache(tmp_path / "compile"), zoo.build("llama", "sdpa"), torch.device("cpu")
    untuned = CONFIG.replace(autotune=False)
    before, before_untuned = cache.graph_key(model, CONFIG, SIGNATURE, device), cache.graph_key(model, untuned,
                                                                                                  SIGNATURE, device)
    key = TuneKey(device="cpu", op="linear", provider="cpu", shapes="16x64:float32", dtype="float32")
    AutotuneCache(tmp_path / "tuned").store(key, {"gemm": "blas", "n_block": 0}, 1.0, 2.0)
    after = cache.graph_key(model, CONFIG, SIGNATURE, device)
    assert after != before  # a retune must not hit graphs that baked in the old configs
    assert cache.graph_key(model, CONFIG, SIGNATURE, device) == after  # and the key is stable while nothing changes
    assert cache.graph_key(model, untuned, SIGNATURE, device) == before_untuned  # autotune off: the cache is not read


@pytest.mark.parametrize("damage", ["flip-entry-byte", "flip-blob-byte", "delete-blob"])
def test_corrupted_entry_warns_once_and_is_rebuilt(tmp_path, damage):
    ids, expected = _first_run(tmp_path)
    entry = next((tmp_path / "entries").glob("*.json"))
    blob = max((tmp_path / "blobs").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    if damage == "flip-entry-byte":
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0xFF
        entry.write_bytes(bytes(data))
    elif damage == "flip-blob-byte":
        data = bytearray(blob.read_bytes())
        data[-10] ^= 0x01
        blob.write_bytes(bytes(data))
    else:
        blob.unlink()
    model = zoo.build("llama", "sdpa")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bucketed = compile_bucketed(model, CONFIG, cache=CompileCache(tmp_path))
        out = bucketed(ids, logits_to_keep=1)
    cache_warnings = [w for w in caught if "ttftc compile cache" in str(w.message)]
    assert len(cache_warnings) == 1 and "corrupted entry" in str(cache_warnings[0].message)
    assert bucketed.source.compiles == 1  # rebuilt
    assert_logits_match(out.logits, expected)
    # ... and the rebuilt entry is good again: a third run hits.
    again = compile_bucketed(zoo.build("llama", "sdpa"), CONFIG, cache=CompileCache(tmp_path))
    again(ids, logits_to_keep=1)
    assert again.source.compiles == 0 and again.source.cache_hits == 1


def test_concurrent_writers_and_readers(tmp_path):
    model = zoo.build("llama", "sdpa")
    source = CompiledGraphs(model, CONFIG, cache=None)
    program = source.get(SIGNATURE)
    device = torch.device("cpu")
    errors = []

    def write():
        try:
            for _ in range(5):
                CompileCache(tmp_path).store_graph(model, CONFIG, program, device)
        except Exception as exc:  # collected: a thread's exception would otherwise vanish
            errors.append(exc)

    def read():
        try:
            for _ in range(10):
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # a half-written entry would warn as corrupted
                    CompileCache(tmp_path).load_graph(model, CONFIG, SIGNATURE, device)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(3)] + [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    loaded = CompileCache(tmp_path).load_graph(model, CONFIG, SIGNATURE, device)
    assert loaded is not None
    assert not list(tmp_path.rglob("*.tmp")), "temporary files were left behind"
    ids = zoo.example_ids(model, 16)
    inputs = {"input_ids": ids, "position_ids": torch.arange(16)[None], "last_index": torch.tensor([15])}
    assert_logits_match(loaded(inputs)["logits"], program(inputs)["logits"])


def test_plan_is_cached_too(tmp_path):
    _first_run(tmp_path)
    plans = list((tmp_path / "plans").glob("*.json"))
    assert len(plans) == 1 and json.loads(plans[0].read_text())["safe"] is True


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TTFTC_COMPILE_CACHE", "off")
    assert default_cache_dir() is None
    monkeypatch.setenv("TTFTC_COMPILE_CACHE", str(tmp_path / "cc"))
    assert default_cache_dir() == tmp_path / "cc"
    monkeypatch.delenv("TTFTC_COMPILE_CACHE")
    monkeypatch.setenv("TTFTC_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "compile"
