"""The prefix cache's disk tier: addressing, validation of every file, the byte budget, restarts, tenants."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
from safetensors.torch import save as save_safetensors

from ttftc.runtime.kv_disk import (FORMAT, STALE_TEMPORARY_S, DiskTierError, KVDiskTier, child_address, child_digest,
                                   clear_directory, directory_usage, root_address, root_digest)
from ttftc.runtime.prefix_cache import PRIVATE, PrefixCache

BLOCK = 4  # tokens per block
SHAPE = (2, 2, 1, BLOCK, 3)  # [layers, k/v, kv_heads, block, head_dim]
BLOCK_BYTES = 2 * 2 * 1 * BLOCK * 3 * 4


def _tier(path, budget=64 * BLOCK_BYTES, model_key="model-a"):
    return KVDiskTier(path, budget, model_key=model_key, dtype=torch.float32, block_shape=SHAPE)


def _payload(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i)) + torch.arange(SHAPE[-1], dtype=torch.float32)


def _cache(tier, budget_blocks=2, recompute=lambda tokens, context: 1.0):
    return PrefixCache(budget_blocks * BLOCK_BYTES, BLOCK, disk=tier, recompute_seconds=recompute)


def _fill(cache, tokens, tenant=None):
    cache.insert(tokens, lambda i: _payload(tokens[i * BLOCK]), tenant=tenant).release()


def test_digests_separate_models_namespaces_and_prefixes():
    roots = {root_digest(m, n) for m in ("a", "b") for n in ("default", "tenant:x")}
    assert len(roots) == 4
    root = root_digest("a", "default")
    assert child_digest(root, (1, 2)) != child_digest(root, (2, 1))
    assert child_digest(child_digest(root, (1,)), (2,)) != child_digest(root, (1, 2))


def test_a_block_round_trips_and_survives_a_new_tier_on_the_same_directory(tmp_path):
    digest = child_address(root_address("model-a", "default"), (1, 2, 3, 4))
    assert _tier(tmp_path).store(digest, _payload(7))
    reopened = _tier(tmp_path)
    assert reopened.contains(digest)
    torch.testing.assert_close(reopened.load(digest), _payload(7), rtol=0, atol=0)
    assert reopened.stats().loaded == 1 and reopened.stats().load_seconds_per_byte > 0
    assert directory_usage(tmp_path)[0] == 1


def _corrupt(path, how):
    data = path.read_bytes()
    if how == "flipped byte":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "not safetensors":
        path.write_bytes(b"\x00" * len(data))
    elif how == "oversized":
        path.write_bytes(data + b"\x00" * (1 << 17))


@pytest.mark.parametrize("how", ["flipped byte", "truncated", "not safetensors", "oversized"])
def test_a_damaged_block_is_refused_deleted_and_counted(tmp_path, how):
    tier = _tier(tmp_path)
    digest = child_address(root_address("model-a", "default"), (1, 2, 3, 4))
    tier.store(digest, _payload(1))
    path = tmp_path / f"{digest.hex()}.safetensors"
    _corrupt(path, how)
    with pytest.warns(UserWarning, match="KV disk tier: refused"):
        assert tier.load(digest) is None
    assert not path.exists() and not tier.contains(digest) and tier.stats().refused == 1


def _forged(tmp_path, address, tensors: dict, metadata: dict):
    base = {"format": FORMAT, "digest": address.hex(), "model_key": "model-a", "sha256": "0" * 64,
            "parent": address.parent.hex(), "namespace": address.namespace.hex()}
    tensors = {"tokens": torch.tensor(address.tokens), **tensors}
    blob = save_safetensors(tensors, metadata={**base, **metadata})
    (tmp_path / f"{address.hex()}.safetensors").write_bytes(blob)


@pytest.mark.parametrize("tensors, metadata, reason", [
    ({"kv": _payload(1)}, {"model_key": "model-b"}, "another model's KV"),
    ({"kv": _payload(1)}, {"format": "something-else"}, "format"),
    ({"kv": _payload(1)}, {"digest": "ab" * 32}, "digest is not its name"),
    # Another dtype, shape or tensor set changes the file's size: the scan deletes it before any load.
    ({"kv": _payload(1), "extra": torch.zeros(1)}, {}, "size is not a block's"),
    ({"kv": _payload(1).double()}, {}, "size is not a block's"),
    ({"kv": _payload(1)[:1]}, {}, "size is not a block's"),
    ({"kv": _payload(1).view(torch.int32)}, {}, "expected torch.float32"),
    ({"kv": _payload(1)}, {}, "checksum"),
])
def test_a_foreign_or_forged_block_is_refused(tmp_path, tensors, metadata, reason):
    digest = child_address(root_address("model-a", "default"), (5, 6, 7, 8))
    _forged(tmp_path, digest, tensors, metadata)
    with pytest.warns(UserWarning, match=reason):
        tier = _tier(tmp_path)
        assert tier.load(digest) is None
    assert not tier.contains(digest) and not (tmp_path / f"{digest.hex()}.safetensors").exists()


def test_a_symlink_is_never_followed(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    store = tmp_path / "tier"
    store.mkdir()
    digest = child_address(root_address("model-a", "default"), (1, 2, 3, 4))
    os.symlink(outside, store / f"{digest.hex()}.safetensors")
    tier = _tier(store)
    assert not tier.contains(digest)  # not indexed: only regular files are blocks
    assert tier.clear() == 0 and outside.read_bytes() == b"secret"


def test_the_budget_evicts_least_recently_used_blocks(tmp_path):
    one = len(save_safetensors({"kv": _payload(0), "tokens": torch.zeros(BLOCK, dtype=torch.int64)},
                               metadata={"format": FORMAT, "digest": "0" * 64, "model_key": "model-a",
                                         "sha256": "0" * 64, "parent": "0" * 64, "namespace": "0" * 64}))
    tier = _tier(tmp_path, budget=3 * one)
    digests = [child_address(root_address("model-a", "default"), (i, i, i, i)) for i in range(4)]
    for i, digest in enumerate(digests[:3]):
        assert tier.store(digest, _payload(i))
    tier.load(digests[0])  # now the most recently used
    assert tier.store(digests[3], _payload(3))
    assert [tier.contains(d) for d in digests] == [True, False, True, True]
    assert tier.stats().bytes <= 3 * one and tier.stats().evicted == 1


def test_a_block_larger_than_the_budget_is_not_stored(tmp_path):
    tier = _tier(tmp_path, budget=BLOCK_BYTES // 2)
    assert not tier.store(child_address(root_address("model-a", "default"), (1, 2, 3, 4)), _payload(1))
    assert directory_usage(tmp_path) == (0, 0)


def test_bad_configuration_is_refused_with_the_fix(tmp_path):
    with pytest.raises(DiskTierError, match="positive integer"):
        _tier(tmp_path, budget=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskTierError, match="is not a directory"):
        _tier(tmp_path / "file")
    with pytest.raises(DiskTierError, match="model_key"):
        _tier(tmp_path, model_key="")
    with pytest.raises(ValueError, match="this tier holds torch.float32"):
        _tier(tmp_path).store(child_address(root_address("model-a", "default"), (1, 2, 3, 4)), _payload(1).half())


def test_stale_temporary_files_are_removed_and_clear_touches_only_blocks(tmp_path):
    tier = _tier(tmp_path)
    tier.store(child_address(root_address("model-a", "default"), (1, 2, 3, 4)), _payload(1))
    stale = tmp_path / f".{'a' * 64}.safetensors.x1y2.tmp"  # a writer that cannot be told alive: judged by age
    stale.write_bytes(b"half")
    old = time.time() - STALE_TEMPORARY_S - 60
    os.utime(stale, (old, old))
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    _tier(tmp_path)
    assert not stale.exists()
    assert clear_directory(tmp_path) == 1 and keep.read_text() == "mine"


# -- the prefix cache with a disk tier --------------------------------------------------------------------------

def test_evicted_blocks_are_found_on_disk_and_count_as_hits(tmp_path):
    cache = _cache(_tier(tmp_path))
    first, second = list(range(8)), list(range(100, 108))
    _fill(cache, first)
    _fill(cache, second)  # evicts both blocks of `first` (a budget of 2 blocks): they go to disk
    assert cache.stats().disk_stored_blocks == 2 and cache.cached_tokens(first) == 0
    lease = cache.match(first + [9])
    assert lease.num_tokens == 8
    torch.testing.assert_close(lease.blocks[1], _payload(4), rtol=0, atol=0)
    lease.release()
    stats = cache.stats()
    assert stats.disk_loaded_blocks == 2 and stats.hit_tokens == 8
    cache.check_invariants()


def test_a_restart_hits_what_persist_wrote(tmp_path):
    cache = _cache(_tier(tmp_path), budget_blocks=4)
    prompt = list(range(12))
    _fill(cache, prompt, tenant="acme")
    assert cache.persist() == 3
    restarted = _cache(_tier(tmp_path), budget_blocks=4)
    lease = restarted.match(prompt, tenant="acme")
    assert lease.num_tokens == 12 and restarted.stats().disk_loaded_blocks == 3
    torch.testing.assert_close(lease.blocks[2], _payload(8), rtol=0, atol=0)
    lease.release()


def test_tenants_and_models_stay_isolated_on_disk(tmp_path):
    cache = _cache(_tier(tmp_path), budget_blocks=4)
    prompt = list(range(8))
    _fill(cache, prompt, tenant="acme")
    _fill(cache, prompt)  # the default namespace: its own blocks
    cache.persist()
    restarted = _cache(_tier(tmp_path), budget_blocks=4)
    assert restarted.match(prompt, tenant="globex").num_tokens == 0
    assert restarted.match(prompt, tenant=PRIVATE).num_tokens == 0
    assert restarted.match(prompt, tenant="acme").num_tokens == 8
    other_model = _cache(_tier(tmp_path, model_key="model-b"), budget_blocks=4)
    assert other_model.match(prompt, tenant="acme").num_tokens == 0
    assert restarted.stats().disk_loaded_blocks == 2


def test_a_private_call_never_reaches_the_disk(tmp_path):
    cache = _cache(_tier(tmp_path), budget_blocks=1)
    cache.insert(list(range(8)), lambda i: _payload(i), tenant=PRIVATE).release()
    assert cache.persist() == 0 and directory_usage(tmp_path) == (0, 0)


@pytest.mark.parametrize("recompute", [None, lambda tokens, context: 0.0])
def test_loading_needs_a_measured_recompute_cost_that_it_beats(tmp_path, recompute):
    cache = _cache(_tier(tmp_path), budget_blocks=4)
    prompt = list(range(8))
    _fill(cache, prompt)
    cache.persist()
    restarted = _cache(_tier(tmp_path), budget_blocks=4, recompute=recompute)
    assert restarted.match(prompt).num_tokens == 0
    assert restarted.stats().disk_declined_blocks == 2 and restarted.stats().disk_loaded_blocks == 0


def test_the_recompute_cost_is_asked_for_the_tokens_on_disk_after_the_ram_chain(tmp_path):
    asked = []
    cache = _cache(_tier(tmp_path), budget_blocks=4)
    prompt = list(range(12))
    _fill(cache, prompt)
    cache.persist()
    restarted = _cache(_tier(tmp_path), budget_blocks=4,
                       recompute=lambda tokens, context: asked.append((tokens, context)) or 1.0)
    _fill(restarted, prompt[:4])  # the first block is in RAM already
    assert restarted.match(prompt).num_tokens == 12
    assert asked == [(8, 4)]


def test_a_corrupt_block_mid_chain_ends_the_hit_there(tmp_path):
    tier = _tier(tmp_path)
    cache = _cache(tier, budget_blocks=4)
    prompt = list(range(12))
    _fill(cache, prompt)
    cache.persist()
    second = child_address(child_address(root_address("model-a", "default"), tuple(prompt[:4])), tuple(prompt[4:8]))
    path = tmp_path / f"{second.hex()}.safetensors"
    path.write_bytes(b"garbage".ljust(path.stat().st_size, b"\0"))  # a block's size: the scan keeps it, a load not
    restarted = _cache(_tier(tmp_path), budget_blocks=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lease = restarted.match(prompt)
    assert lease.num_tokens == 4 and any("refused" in str(w.message) for w in caught)
    restarted.check_invariants([lease])


def test_a_tier_for_other_blocks_is_refused(tmp_path):
    with pytest.raises(ValueError, match="blocks of 4 tokens; this cache's blocks have 8"):
        PrefixCache(16 * BLOCK_BYTES, 8, disk=_tier(tmp_path))
