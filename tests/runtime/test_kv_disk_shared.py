"""One disk-tier directory shared by several tiers (the replicas of a fleet): each finds the blocks the others
write, writers never tear a block, the start-up scan spares live writers' temporary files, and the budget counts
every block in the directory. Two tiers in one process stand for two processes (each has its own index and lock);
the concurrent-writer test also runs real processes, and the last test two `ttftc.LLM`s, as a fleet's replicas."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

import ttftc
from ttftc.runtime import kv_disk
from ttftc.runtime.kv_disk import (STALE_TEMPORARY_S, KVDiskTier, child_address, directory_usage, host_identity,
                                   root_address)
from ttftc.runtime.prefix_cache import PrefixCache

BLOCK = 4  # tokens per block
SHAPE = (2, 2, 1, BLOCK, 3)  # [layers, k/v, kv_heads, block, head_dim]
BLOCK_BYTES = 2 * 2 * 1 * BLOCK * 3 * 4
MODEL = "model-a"


def _tier(path, budget=64 * BLOCK_BYTES, **kwargs):
    return KVDiskTier(path, budget, model_key=MODEL, dtype=torch.float32, block_shape=SHAPE, **kwargs)


def _payload(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i)) + torch.arange(SHAPE[-1], dtype=torch.float32)


def _cache(tier, budget_blocks=2):
    return PrefixCache(budget_blocks * BLOCK_BYTES, BLOCK, disk=tier, recompute_seconds=lambda tokens, context: 1.0)


def _fill(cache, tokens, tenant=None):
    cache.insert(tokens, lambda i: _payload(tokens[i * BLOCK]), tenant=tenant).release()


def _address(i: int, tenant: str = "default"):
    return child_address(root_address(MODEL, tenant), (i, i + 1, i + 2, i + 3))


def _block_names(path) -> set[str]:
    return {p.name for p in path.iterdir() if p.name.endswith(".safetensors") and not p.name.startswith(".")}


def _temporaries(path) -> list[str]:
    return [p.name for p in path.iterdir() if p.name.endswith(".tmp")]


# -- finding what another tier wrote ------------------------------------------------------------------------------

def test_a_cache_hits_a_block_another_tier_wrote_after_it_started(tmp_path):
    reader = _cache(_tier(tmp_path), budget_blocks=4)  # started first: its start-up listing saw nothing
    writer = _cache(_tier(tmp_path), budget_blocks=4)
    prompt = list(range(12))
    _fill(writer, prompt, tenant="acme")
    assert writer.persist() == 3
    lease = reader.match(prompt + [99], tenant="acme")
    assert lease.num_tokens == 12 and reader.stats().disk_loaded_blocks == 3
    torch.testing.assert_close(lease.blocks[2], _payload(8), rtol=0, atol=0)
    lease.release()
    assert reader.match(prompt, tenant="globex").num_tokens == 0  # another tenant's namespace: never found
    reader.check_invariants()


def test_a_block_another_tier_evicted_is_found_while_both_run(tmp_path):
    a, b = _cache(_tier(tmp_path)), _cache(_tier(tmp_path))
    first, second = list(range(8)), list(range(100, 108))
    _fill(a, first)
    _fill(a, second)  # a budget of 2 blocks: `first` goes to the shared directory
    lease = b.match(first)
    assert lease.num_tokens == 8 and b.stats().disk_loaded_blocks == 2
    lease.release()


def test_a_new_tier_starts_warm_from_the_blocks_already_there(tmp_path):
    a = _tier(tmp_path)
    for i in range(3):
        assert a.store(_address(i), _payload(i))
    b = _tier(tmp_path)
    assert b.stats().blocks == 3 and b.stats().bytes == 3 * b.file_bytes
    torch.testing.assert_close(b.load(_address(1)), _payload(1), rtol=0, atol=0)


def test_a_block_deleted_by_another_tier_is_a_clean_miss(tmp_path):
    a, b = _tier(tmp_path), _tier(tmp_path)
    assert a.store(_address(0), _payload(0)) and b.contains(_address(0))
    assert a.clear() == 1  # gone between b's lookup and its read
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a miss, not a refusal
        assert b.load(_address(0)) is None
    assert not b.contains(_address(0)) and b.stats().refused == 0 and b.stats().blocks == 0


def test_a_block_published_already_is_not_written_again(tmp_path):
    a, b = _tier(tmp_path), _tier(tmp_path)
    assert a.store(_address(0), _payload(0))
    before = os.stat(tmp_path / f"{_address(0).hex()}.safetensors").st_ino
    assert b.store(_address(0), _payload(0))
    assert b.stats().stored == 0 and b.stats().blocks == 1
    assert os.stat(tmp_path / f"{_address(0).hex()}.safetensors").st_ino == before


def test_a_block_another_tier_deleted_is_written_again(tmp_path):
    a, b = _tier(tmp_path), _tier(tmp_path)
    assert a.store(_address(0), _payload(0)) and b.contains(_address(0))
    a.clear()
    assert b.store(_address(0), _payload(0)) and b.stats().stored == 1  # its index said "there": checked on disk
    assert a.contains(_address(0))


# -- concurrent writers -------------------------------------------------------------------------------------------

def _assert_every_file_is_a_valid_block(path, expected: dict[int, torch.Tensor]):
    assert _temporaries(path) == []
    assert _block_names(path) == {f"{_address(i).hex()}.safetensors" for i in expected}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any refusal fails the test
        check = _tier(path)
        for i, payload in expected.items():
            torch.testing.assert_close(check.load(_address(i)), payload, rtol=0, atol=0)
    assert check.stats().refused == 0


def test_threads_publishing_the_same_and_different_blocks_leave_only_valid_blocks(tmp_path):
    tiers = [_tier(tmp_path, rescan_s=0) for _ in range(4)]  # listings in the background throughout
    shared, rounds = range(8), 20
    start, errors = threading.Barrier(len(tiers)), []

    def write(k: int, tier: KVDiskTier) -> None:
        try:
            start.wait(timeout=60)
            for _ in range(rounds):
                for i in shared:
                    assert tier.store(_address(i), _payload(i))
                assert tier.store(_address(100 + k), _payload(100 + k))
                tier.clear()  # deletes what it indexed: the others publish it again, and find it gone
        except BaseException as exc:  # reported below: an exception in a thread would otherwise be lost
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(k, tier)) for k, tier in enumerate(tiers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    for k, tier in enumerate(tiers):  # a last round, undisturbed, so the directory holds every block
        for i in shared:
            tier.store(_address(i), _payload(i))
        tier.store(_address(100 + k), _payload(100 + k))
    _assert_every_file_is_a_valid_block(tmp_path, {i: _payload(i) for i in [*shared, 100, 101, 102, 103]})


_WRITER = textwrap.dedent("""
    import sys, torch
    from ttftc.runtime.kv_disk import KVDiskTier, child_address, root_address
    directory, me, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tier = KVDiskTier(directory, 1 << 30, model_key="model-a", dtype=torch.float32, block_shape=(2, 2, 1, 4, 3))
    for _ in range(rounds):
        for i in [*range(8), 100 + me]:
            payload = torch.full((2, 2, 1, 4, 3), float(i)) + torch.arange(3, dtype=torch.float32)
            assert tier.store(child_address(root_address("model-a", "default"), (i, i + 1, i + 2, i + 3)), payload)
        tier.clear()
    for i in [*range(8), 100 + me]:
        payload = torch.full((2, 2, 1, 4, 3), float(i)) + torch.arange(3, dtype=torch.float32)
        assert tier.store(child_address(root_address("model-a", "default"), (i, i + 1, i + 2, i + 3)), payload)
""")


def test_processes_publishing_the_same_and_different_blocks_leave_only_valid_blocks(tmp_path):
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(k), "30"],
                                stderr=subprocess.PIPE, text=True) for k in range(3)]
    for writer in writers:
        _, err = writer.communicate(timeout=600)
        assert writer.returncode == 0, err[-2000:]
    # Each writer's last round ran after its own last clear; another writer's clear may have come later.
    survivors = {i for i in [*range(8), 100, 101, 102] if (tmp_path / f"{_address(i).hex()}.safetensors").exists()}
    assert survivors  # the last writer's final round at least
    _assert_every_file_is_a_valid_block(tmp_path, {i: _payload(i) for i in survivors})


# -- the start-up scan and temporary files -------------------------------------------------------------------------

def _temporary(path, writer: str, age_s: float = 0.0):
    """A temporary file as `writer` (host identity, pid, random) leaves it, written `age_s` seconds ago."""
    tmp = path / f".{_address(0).hex()}.safetensors.{writer}.tmp"
    tmp.write_bytes(b"half a block")
    if age_s:
        then = time.time() - age_s
        os.utime(tmp, (then, then))
    return tmp


def test_a_writers_temporary_name_says_who_wrote_it(tmp_path):
    name = kv_disk._temporary_name(tmp_path / f"{_address(0).hex()}.safetensors").name
    match = kv_disk._TMP.match(name)
    assert match is not None
    writer = kv_disk._WRITER.match(match.group(1)) if host_identity() is not None else None
    if writer is not None:
        assert writer.group(1) == host_identity() and int(writer.group(2)) == os.getpid()


@pytest.mark.skipif(host_identity() is None, reason="a writer's pid is checked only where /proc names the host")
def test_the_start_up_scan_keeps_a_live_writers_temporary_file_and_deletes_a_dead_ones(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        live = _temporary(tmp_path, f"{host_identity()}-{child.pid}-{'0' * 12}")
        mine = _temporary(tmp_path, f"{host_identity()}-{os.getpid()}-{'1' * 12}")
        _tier(tmp_path)
        assert live.exists() and mine.exists()
    finally:
        child.kill()
        child.wait(timeout=60)
    _tier(tmp_path)  # the child's pid no longer runs: its file can only be a leftover
    assert not live.exists() and mine.exists()


@pytest.mark.skipif(host_identity() is None, reason="a writer's pid is checked only where /proc names the host")
def test_a_temporary_file_from_another_host_is_judged_by_its_age_alone(tmp_path):
    other_host = "f" * 16 if host_identity() != "f" * 16 else "e" * 16
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()
    elsewhere = _temporary(tmp_path, f"{other_host}-{dead_pid}-{'0' * 12}")  # that pid may run over there
    _tier(tmp_path)
    assert elsewhere.exists()


def test_a_stale_temporary_file_is_deleted_whoever_wrote_it_and_a_fresh_unknown_one_kept(tmp_path):
    stale_live = _temporary(tmp_path, f"{host_identity() or 'unknown'}-{os.getpid()}-{'2' * 12}",
                            age_s=STALE_TEMPORARY_S + 60)
    fresh_unknown = tmp_path / f".{_address(1).hex()}.safetensors.x1y2.tmp"
    fresh_unknown.write_bytes(b"half")
    _tier(tmp_path)
    assert not stale_live.exists() and fresh_unknown.exists()


def test_only_the_start_up_scan_deletes_temporary_files(tmp_path):
    tier = _tier(tmp_path)
    stale = _temporary(tmp_path, "unknown-1-000000000000", age_s=STALE_TEMPORARY_S + 60)
    tier.refresh()
    assert tier.store(_address(0), _payload(0))
    assert stale.exists()


# -- the budget over a shared directory ----------------------------------------------------------------------------

def test_each_tier_keeps_the_whole_directory_within_its_budget_evicting_the_oldest(tmp_path):
    budget = 4 * _tier(tmp_path).file_bytes  # room for 4 files (a file is a block plus its header)
    a, b = _tier(tmp_path, budget=budget, rescan_s=3600), _tier(tmp_path, budget=budget, rescan_s=3600)
    for i in range(3):
        assert a.store(_address(i), _payload(i))
    for i in range(10, 13):
        assert b.store(_address(i), _payload(i))
    assert len(_block_names(tmp_path)) == 6  # b counts its own 3 until it lists the directory again
    b.refresh()
    assert _block_names(tmp_path) == {f"{_address(i).hex()}.safetensors" for i in (2, 10, 11, 12)}
    assert b.stats().evicted == 2 and b.stats().bytes == budget
    assert directory_usage(tmp_path) == (4, budget)


def test_a_storing_tier_lists_the_directory_in_the_background(tmp_path):
    writer = _tier(tmp_path)
    for i in range(6):
        assert writer.store(_address(i), _payload(i))
    budget = 4 * writer.file_bytes
    tier = _tier(tmp_path, budget=budget, rescan_s=0)  # its start-up scan trims the directory to 4 blocks
    assert len(_block_names(tmp_path)) == 4
    for i in range(6, 9):
        assert writer.store(_address(i), _payload(i))  # 7 blocks now: the tier knows of 4
    deadline = time.monotonic() + 120  # a hang guard, not a time budget
    while True:
        assert tier.store(_address(10), _payload(10))  # once a listing is due, a store starts one on a thread
        if len(_block_names(tmp_path)) <= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(_block_names(tmp_path)) == 4 and tier.contains(_address(10))
    assert tier.stats().bytes == budget


def test_a_load_by_another_tier_makes_a_block_recent_before_it_is_evicted(tmp_path):
    budget = 3 * _tier(tmp_path).file_bytes
    a, b = _tier(tmp_path, budget=budget, rescan_s=3600), _tier(tmp_path, budget=budget, rescan_s=3600)
    for i in range(3):
        assert a.store(_address(i), _payload(i))
    assert b.load(_address(0)) is not None  # the most recently used now, also for a: its mtime moved
    assert a.store(_address(3), _payload(3))  # a's own order says block 0 is oldest; its file says otherwise
    assert [a.contains(_address(i)) for i in range(4)] == [True, False, True, True]


def test_what_a_tier_writes_or_drops_while_it_lists_outlives_the_listing(tmp_path, monkeypatch):
    tier = _tier(tmp_path, rescan_s=3600)
    for i in (0, 2):
        assert tier.store(_address(i), _payload(i))
    listing = tier._list

    def list_then_work(known):
        listed = listing(known)  # blocks 0 and 2; what follows happens before the listing is merged
        assert tier.store(_address(1), _payload(1)) and tier.store(_address(3), _payload(3))
        os.unlink(tmp_path / f"{_address(2).hex()}.safetensors")  # another process's budget takes block 2
        assert tier.load(_address(2)) is None
        return listed

    monkeypatch.setattr(tier, "_list", list_then_work)
    tier.refresh()
    assert tier.stats().blocks == 3 and tier.stats().bytes == 3 * tier.file_bytes  # 0, 1 and 3; not 2


# -- two LLMs on one directory, as two replicas of a fleet run ----------------------------------------------------

TINY_BLOCK_BYTES = 2 * 2 * 2 * 16 * 64 * 4  # tiny's KV block: 2 layers x (K, V) x 2 heads x 16 tokens x 64 x fp32


def _tiny(directory):
    # A RAM cache of 3 blocks: a prompt's blocks go to the directory as soon as the LLM serves another prompt.
    return ttftc.LLM("tiny", precision="fp32", buckets=None, compile_kv_path=False, kv_disk=directory,
                     kv_disk_bytes=64 << 20, prefix_cache_bytes=3 * TINY_BLOCK_BYTES)


def test_an_llm_hits_a_prefix_that_another_running_llm_wrote(tmp_path):
    prompt = [(7 * i + 3) % 500 for i in range(48)] + [1, 2]  # 3 full blocks of 16
    filler = [(13 * i + 1) % 500 for i in range(48)] + [1, 2]
    writer, reader = _tiny(tmp_path), _tiny(tmp_path)  # both running before any block is written
    try:
        assert writer.generate(prompt, max_new_tokens=1, tenant="acme")[0].cached_tokens == 0
        writer.generate(filler, max_new_tokens=1, tenant="acme")  # evicts the prompt's blocks to the directory
        assert len(_block_names(tmp_path)) == 3
        assert reader.generate(prompt, max_new_tokens=1, tenant="globex")[0].cached_tokens == 0
        assert reader.generate(prompt, max_new_tokens=1, tenant="acme")[0].cached_tokens == 48
    finally:
        writer.close(drain_timeout_s=5)
        reader.close(drain_timeout_s=5)
