"""Issue items 3 and 4 on the compile cache: a crafted entry is a miss with one warning, never code and never a
deleted file; a poisoned cache does not carry into a freshly built artifact.

Cache entries have no checksum to recompute: an attacker with write access to the cache directory edits them directly.
"""

import json
import os
import shutil
import warnings

import pytest
import torch

import ttftc
from tests.helpers import needs_transformers
from tests.security.attack import read_json, write_json
from ttftc import zoo
from ttftc.aot import build_artifact
from ttftc.cache import CompileCache
from ttftc.bucketed import compile_bucketed

pytestmark = needs_transformers
CONFIG = ttftc.Config(buckets=(16,))


@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    """One bucket of a tiny llama compiled into a cache once: (cache directory, ids, logits)."""
    root = tmp_path_factory.mktemp("template") / "cache"
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 10)
    logits = compile_bucketed(model, CONFIG, cache=CompileCache(root))(ids, logits_to_keep=1).logits
    return root, ids, logits


@pytest.fixture
def cache(populated, tmp_path):
    """A private copy of the populated cache: (root, a fresh model object, ids, logits, the graph entry)."""
    template, ids, logits = populated
    root = shutil.copytree(template, tmp_path / "cache")
    (entry,) = (root / "entries").glob("*.json")
    return root, zoo.build("llama", "sdpa"), ids, logits, entry


def _load_again(root, model, ids):
    """A later process: a new cache object on the same directory. Returns (bucketed model, logits, warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bucketed = compile_bucketed(model, CONFIG, cache=CompileCache(root))
        logits = bucketed(ids, logits_to_keep=1).logits
    return bucketed, logits, [w for w in caught if "compile cache" in str(w.message)]


def _poison(entry, mutate):
    data = read_json(entry)
    mutate(data["program"])
    write_json(entry, data)


def _anchor_node(program):
    """A unary aten node every cached graph keeps after the passes (the RoPE table's cos)."""
    return next(n for n in program["nodes"] if n.get("target") == {"op": "aten::cos.default"})


def test_an_edited_keyword_name_is_a_miss_with_one_warning(cache, outside):
    root, model, ids, expected, entry = cache
    _poison(entry, lambda p: _anchor_node(p).update(kwargs={"dict": {f"x={outside.python_payload},y": 1}}))
    bucketed, logits, caught = _load_again(root, model, ids)
    assert len(caught) == 1 and "not a plain Python identifier" in str(caught[0].message)
    assert bucketed.source.cache_hits == 0 and bucketed.source.compiles == 1  # recompiled, not loaded
    assert torch.equal(logits, expected)
    outside.assert_untouched()


def test_a_poisoned_cache_does_not_carry_into_a_new_artifact(tmp_path, outside):
    cache_root = tmp_path / "cache"
    build_artifact("tiny", tmp_path / "first", CONFIG, cache=CompileCache(cache_root))
    payload = f"x={outside.python_payload},y"
    for entry in (cache_root / "entries").glob("*.json"):
        _poison(entry, lambda p: _anchor_node(p).update(kwargs={"dict": {payload: 1}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh = build_artifact("tiny", tmp_path / "fresh", CONFIG, cache=CompileCache(cache_root))
    assert any("ignoring corrupted entry" in str(w.message) for w in caught)
    for graph in (fresh / "graphs").glob("*.json"):
        assert "__import__" not in graph.read_text()
    ttftc.load(fresh)(torch.arange(5).unsqueeze(0), logits_to_keep=1)
    outside.assert_untouched()


@pytest.mark.parametrize("key", ["../../outside/victim", "/{outside}/victim", "../" * 8 + "{outside}/victim",
                                 "ABCDEF" * 10 + "0123", "0" * 63, "0" * 64 + "/.."])
def test_a_blob_key_never_becomes_a_path_outside_the_cache(cache, outside, key):
    """The review's exploit: the key of a constant came from the entry and its error path unlinked that path."""
    root, model, ids, expected, entry = cache
    key = key.format(outside=str(outside.root).lstrip("/"))
    _poison(entry, lambda p: next(iter(p["constants"].values())).update(key=key))
    bucketed, logits, caught = _load_again(root, model, ids)
    assert len(caught) == 1 and "hex digest" in str(caught[0].message)
    assert torch.equal(logits, expected)
    outside.assert_untouched()  # victim.safetensors is still there


def test_a_blob_symlinked_out_of_the_cache_is_not_followed(cache, outside):
    root, model, ids, expected, entry = cache
    blob = next((root / "blobs").glob("*.safetensors"))
    blob.unlink()
    blob.symlink_to(outside.victims[0])
    _, logits, caught = _load_again(root, model, ids)
    assert len(caught) == 1 and "not a regular file" in str(caught[0].message)
    assert torch.equal(logits, expected)
    outside.assert_untouched()


def test_a_cache_subdirectory_symlinked_out_of_the_cache_is_not_used(tmp_path, outside):
    root = tmp_path / "cache"
    root.mkdir()
    (root / "entries").symlink_to(outside.root, target_is_directory=True)
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_bucketed(model, CONFIG, cache=CompileCache(root))(ids, logits_to_keep=1)
    assert any("leads outside" in str(w.message) for w in caught)
    outside.assert_untouched()  # nothing was written into the directory the symlink points at


def test_a_cache_entry_that_is_a_fifo_does_not_block_the_reader(cache, outside):
    root, model, ids, expected, entry = cache
    entry.unlink()
    os.mkfifo(entry)
    _, logits, caught = _load_again(root, model, ids)
    assert len(caught) == 1 and "regular file" in str(caught[0].message)
    assert torch.equal(logits, expected)
    outside.assert_untouched()


def test_an_entry_holding_another_signature_is_a_miss(cache, outside):
    root, model, ids, expected, entry = cache
    data = read_json(entry)
    data["program"]["signature"]["bucket"] = 32
    data["signature"] = "b32_n1_last_kv"
    entry.write_text(json.dumps(data))
    _, logits, caught = _load_again(root, model, ids)
    assert len(caught) == 1 and "not b16_n1_last_kv" in str(caught[0].message)
    assert torch.equal(logits, expected)
    outside.assert_untouched()
