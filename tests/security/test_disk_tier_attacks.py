"""Issue 40, finding 6: the prefix cache's disk tier verifies what it serves.

The attacker can write the tier's directory: they copy one tenant's block under another tenant's (or another
prompt's) name and recompute its metadata and checksum, plant NaN payloads, a header nested deep enough to exhaust
the recursion limit, a directory in a block's place, or one sparse terabyte named like a block. Each is a clean miss
(a refusal that deletes the file, also across a restart), never a 500, a leaked descriptor or another tenant's KV.
Files are located by the digest chain (`root_digest`/`child_digest`), which names a block's file in every format.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ttftc.runtime.kv_disk import KVDiskTier, child_digest, root_digest
from ttftc.runtime.prefix_cache import PrefixCache

BLOCK = 4
SHAPE = (2, 2, 1, BLOCK, 256)  # [layers, k/v, kv_heads, block, head_dim]: room for a header nested 2000 deep
BLOCK_BYTES = 2 * 2 * 1 * BLOCK * 256 * 4
MODEL = "model-a"
PROMPT = list(range(12))  # three blocks


def _tier(path, budget=64 * BLOCK_BYTES):
    return KVDiskTier(path, budget, model_key=MODEL, dtype=torch.float32, block_shape=SHAPE)


def _cache(path, budget=64 * BLOCK_BYTES):
    return PrefixCache(4 * BLOCK_BYTES, BLOCK, disk=_tier(path, budget), recompute_seconds=lambda tokens, context: 1.0)


def _payload(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i)) + torch.arange(SHAPE[-1], dtype=torch.float32)


def _persist(path, prompt=PROMPT, tenant=None) -> None:
    cache = _cache(path)
    cache.insert(prompt, lambda i: _payload(prompt[i * BLOCK]), tenant=tenant).release()
    assert cache.persist() == len(prompt) // BLOCK


def _block_file(path, prompt, blocks: int, tenant=None):
    """The file of the `blocks`-th block of `prompt` in `tenant`'s namespace."""
    digest = root_digest(MODEL, "default" if tenant is None else f"tenant:{tenant}")
    for i in range(blocks):
        digest = child_digest(digest, tuple(prompt[i * BLOCK:(i + 1) * BLOCK]))
    return path / f"{digest.hex()}.safetensors"


def _forge(source, target, kv=None) -> None:
    """What an attacker with write access does: `source`'s block (its payload replaced by `kv`) written as the file
    `target`, with the recorded digest and checksum recomputed to match; every other field is kept."""
    with safe_open(str(source), "pt") as f:
        metadata = dict(f.metadata())
    tensors = load_safetensors(source.read_bytes())
    if kv is not None:
        tensors["kv"] = kv
    metadata["digest"] = target.name.split(".")[0]
    metadata["sha256"] = hashlib.sha256(tensors["kv"].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    target.write_bytes(save_safetensors(tensors, metadata=metadata))


def _match(path, prompt=PROMPT, tenant=None):
    """A restarted server's first request: (tokens served from the cache, the refusal warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = _cache(path)
        lease = cache.match(prompt, tenant=tenant)
    served = lease.num_tokens, [b.clone() for b in lease.blocks]
    lease.release()
    cache.check_invariants()
    return served, [str(w.message) for w in caught if "KV disk tier" in str(w.message)]


def test_a_block_copied_to_another_tenants_address_is_never_served_to_it(tmp_path):
    _persist(tmp_path, tenant="acme")
    for blocks in (1, 2, 3):  # the attacker plants acme's chain where globex's request for the same prompt looks
        _forge(_block_file(tmp_path, PROMPT, blocks, "acme"), _block_file(tmp_path, PROMPT, blocks, "globex"))
    (tokens, _), refusals = _match(tmp_path, tenant="globex")
    assert tokens == 0
    assert len(refusals) == 1 and "another tenant" in refusals[0]
    assert not _block_file(tmp_path, PROMPT, 1, "globex").exists()
    assert _match(tmp_path, tenant="acme")[0][0] == 12  # the owner's blocks are untouched


def test_a_block_copied_to_another_prompts_address_is_refused(tmp_path):
    _persist(tmp_path)
    other = [99] * BLOCK + PROMPT[BLOCK:]  # the same second block behind another first one
    _persist(tmp_path, other[:BLOCK])
    _forge(_block_file(tmp_path, PROMPT, 2), _block_file(tmp_path, other, 2))
    (tokens, _), refusals = _match(tmp_path, other[:8])
    assert tokens == 4 and len(refusals) == 1 and "another prefix" in refusals[0]
    assert not _block_file(tmp_path, other, 2).exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_payload_is_refused(tmp_path, value):
    _persist(tmp_path)
    second = _block_file(tmp_path, PROMPT, 2)
    poisoned = _payload(4)
    poisoned[0, 0, 0, 1, 2] = value
    _forge(second, second, kv=poisoned)
    (tokens, _), refusals = _match(tmp_path)
    assert tokens == 4 and len(refusals) == 1 and "non-finite" in refusals[0]
    assert not second.exists()


def _nested_header_block(path, depth: int) -> None:
    """The file at `path` rewritten, same size, as a safetensors header nested `depth` levels deep."""
    size = path.stat().st_size
    header = b'{"a":' + b"[" * depth + b"]" * depth + b"}"
    path.write_bytes((len(header).to_bytes(8, "little") + header).ljust(size, b"\0"))


def test_a_deeply_nested_header_is_a_clean_miss_and_the_file_is_gone_after_a_restart(tmp_path):
    _persist(tmp_path)
    second = _block_file(tmp_path, PROMPT, 2)
    depth = (second.stat().st_size - 32) // 2  # as deep as the file's size allows
    assert depth > 2 * sys.getrecursionlimit()
    _nested_header_block(second, depth)
    (tokens, blocks), refusals = _match(tmp_path)  # raised RecursionError: a 500 for every request with the prefix
    assert tokens == 4 and len(refusals) == 1
    torch.testing.assert_close(blocks[0], _payload(0), rtol=0, atol=0)
    assert not second.exists()
    (tokens, _), refusals = _match(tmp_path)  # another restart: a clean miss, nothing left to refuse
    assert tokens == 4 and refusals == []


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_directory_in_a_blocks_place_leaks_no_descriptor_and_is_a_miss(tmp_path):
    cache = _cache(tmp_path)
    cache.insert(PROMPT, lambda i: _payload(PROMPT[i * BLOCK]), tenant=None).release()
    cache.persist()
    cache.clear()  # RAM empty: every match goes to the disk
    first = _block_file(tmp_path, PROMPT, 1)
    first.unlink()
    first.mkdir()  # indexed as a block, now a directory
    before = _open_descriptors()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(50):
            lease = cache.match(PROMPT)
            assert lease.num_tokens == 0
            lease.release()
    assert _open_descriptors() == before
    refusals = [str(w.message) for w in caught if "KV disk tier" in str(w.message)]
    assert len(refusals) == 1 and "not a regular file" in refusals[0] and "could not delete" in refusals[0]
    assert first.is_dir()  # a directory is not the tier's to remove; it is simply no block


def test_one_huge_file_named_like_a_block_does_not_evict_the_valid_ones(tmp_path):
    _persist(tmp_path)
    huge = tmp_path / f"{'ab' * 32}.safetensors"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)  # sparse: a terabyte that costs nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tier = _tier(tmp_path, budget=16 * BLOCK_BYTES)
    assert not huge.exists() and any("size is not a block's" in str(w.message) for w in caught)
    assert tier.stats().blocks == 3 and tier.stats().evicted == 0 and tier.stats().bytes <= 16 * BLOCK_BYTES
    assert _match(tmp_path)[0][0] == 12


def test_a_block_of_the_previous_format_is_a_miss_not_misread(tmp_path):
    """Format 1 stored no tokens: such a block, valid in every field it has, is never served."""
    digest = child_digest(root_digest(MODEL, "default"), tuple(PROMPT[:BLOCK]))
    kv = _payload(0)
    metadata = {"format": "ttftc-kv-block-1", "digest": digest.hex(), "model_key": MODEL,
                "sha256": hashlib.sha256(kv.view(torch.uint8).numpy().tobytes()).hexdigest()}
    old = tmp_path / f"{digest.hex()}.safetensors"
    old.write_bytes(save_safetensors({"kv": kv}, metadata=metadata))
    (tokens, _), refusals = _match(tmp_path)
    assert tokens == 0 and not old.exists()
    assert len(refusals) == 1 and "size is not a block's" in refusals[0]  # its size differs: the scan deletes it


def test_a_forged_header_that_is_no_object_is_refused(tmp_path):
    _persist(tmp_path)
    first = _block_file(tmp_path, PROMPT, 1)
    size = first.stat().st_size
    header = json.dumps([1, 2, 3]).encode()
    first.write_bytes((len(header).to_bytes(8, "little") + header).ljust(size, b"\0"))
    (tokens, _), refusals = _match(tmp_path)
    assert tokens == 0 and len(refusals) == 1 and not first.exists()


# -- a directory shared by live tiers: what is planted after a tier started is checked like the rest ---------------

def _live_match(cache, prompt=PROMPT, tenant=None):
    """A running server's request (its tier listed the directory before the attack): (tokens, refusal warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lease = cache.match(prompt, tenant=tenant)
    tokens = lease.num_tokens
    lease.release()
    cache.check_invariants()
    return tokens, [str(w.message) for w in caught if "KV disk tier" in str(w.message)]


def test_a_block_planted_for_another_tenant_after_start_is_refused_on_its_first_hit(tmp_path):
    running = _cache(tmp_path)  # a replica that started before any block was written
    _persist(tmp_path, tenant="acme")  # another replica writes acme's blocks
    for blocks in (1, 2, 3):
        _forge(_block_file(tmp_path, PROMPT, blocks, "acme"), _block_file(tmp_path, PROMPT, blocks, "globex"))
    tokens, refusals = _live_match(running, tenant="globex")
    assert tokens == 0 and len(refusals) == 1 and "another tenant" in refusals[0]
    assert not _block_file(tmp_path, PROMPT, 1, "globex").exists()
    assert _live_match(running, tenant="acme") == (12, [])  # the owner's blocks, found on disk, are served


def test_a_symlink_planted_after_start_is_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _persist(elsewhere)  # valid blocks, outside the tier's directory
    store = tmp_path / "tier"
    running = _cache(store)
    os.symlink(_block_file(elsewhere, PROMPT, 1), _block_file(store, PROMPT, 1))
    assert _live_match(running) == (0, [])  # a link is no block: not found, not read, not refused
    assert _block_file(elsewhere, PROMPT, 1).exists() and running.disk.stats().blocks == 0


def test_a_huge_file_planted_after_start_is_neither_read_nor_counted(tmp_path):
    tier = _tier(tmp_path, budget=4 * BLOCK_BYTES + 4096)
    running = PrefixCache(4 * BLOCK_BYTES, BLOCK, disk=tier, recompute_seconds=lambda tokens, context: 1.0)
    huge = _block_file(tmp_path, PROMPT, 1)
    with open(huge, "wb") as f:
        f.truncate(1 << 40)  # sparse: a terabyte that costs nothing, at the first block's own address
    tier.refresh()  # the tier lists the directory again, as it does in the background while it stores
    assert _live_match(running) == (0, [])  # not taken for a block: a miss, nothing read
    other = [50 + t for t in PROMPT]
    running.insert(other, lambda i: _payload(other[i * BLOCK])).release()
    assert running.persist() == 3  # the terabyte is not in the budget: nothing valid was evicted for it
    assert tier.stats().evicted == 0 and tier.stats().bytes == 3 * tier.file_bytes
    running.insert(PROMPT, lambda i: _payload(PROMPT[i * BLOCK])).release()
    running.persist()  # the first block's own file takes its place
    assert huge.stat().st_size == tier.file_bytes and _match(tmp_path)[0][0] == 12
