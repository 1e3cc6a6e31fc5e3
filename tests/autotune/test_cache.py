"""The autotune cache: round trips, survives corruption, staleness and concurrent writers, never crashes."""

import json
import multiprocessing
import subprocess
import sys
import textwrap
import warnings

import pytest

from ttftc.autotune import cache as cache_module
from ttftc.autotune.cache import AutotuneCache, TuneKey

KEY = TuneKey(device="cpu:test:2 threads", op="attention", provider="triton", shapes="1x2x16x16:float32", dtype="float32")


def test_round_trip(tmp_path):
    cache = AutotuneCache(tmp_path)
    assert cache.lookup(KEY) is None
    cache.store(KEY, {"BLOCK_M": 32, "num_warps": 4}, tuned_ms=1.5, default_ms=2.0)
    entry = AutotuneCache(tmp_path).lookup(KEY)
    assert entry.config == {"BLOCK_M": 32, "num_warps": 4}
    assert (entry.tuned_ms, entry.default_ms) == (1.5, 2.0)
    assert [e.key for e in AutotuneCache(tmp_path).entries()] == [KEY]
    assert not list(tmp_path.glob(".*tmp")), "no temporary file may be left behind"


def test_round_trip_across_processes(tmp_path):
    AutotuneCache(tmp_path).store(KEY, {"BLOCK_N": 64}, tuned_ms=1.0, default_ms=1.0)
    script = textwrap.dedent(
        f"""
        from ttftc.autotune.cache import AutotuneCache, TuneKey
        key = TuneKey(**{KEY.__dict__!r})
        print(AutotuneCache({str(tmp_path)!r}).lookup(key).config["BLOCK_N"])
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "64"


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_schema", "wrong_key"])
def test_corrupt_entry_is_ignored_with_one_warning(tmp_path, damage):
    cache = AutotuneCache(tmp_path)
    cache.store(KEY, {"BLOCK_M": 32}, 1.0, 1.0)
    path = tmp_path / f"{KEY.digest()}.json"
    text = path.read_text()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "wrong_schema":
        path.write_text(json.dumps({**json.loads(text), "schema": 999}))
    else:
        raw = json.loads(text)
        raw["key"]["op"] = "gated_ffn"
        path.write_text(json.dumps(raw))
    fresh = AutotuneCache(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fresh.lookup(KEY) is None
        assert fresh.lookup(KEY) is None
        assert list(fresh.entries()) == []
    assert len(caught) == 1 and "ignoring" in str(caught[0].message)


def test_stale_entry_from_another_version_is_ignored(tmp_path, monkeypatch):
    AutotuneCache(tmp_path).store(KEY, {"BLOCK_M": 32}, 1.0, 1.0)
    monkeypatch.setattr(cache_module, "current_versions", lambda: {"ttftc": "9.9", "torch": "x", "triton": "y"})
    with pytest.warns(UserWarning, match="stale"):
        assert AutotuneCache(tmp_path).lookup(KEY) is None


def _writer(directory, worker):
    cache = AutotuneCache(directory)
    for i in range(30):
        cache.store(KEY, {"worker": worker, "i": i, "pad": "x" * 2000}, float(i), float(i))


def test_concurrent_writers_leave_one_whole_entry(tmp_path):
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(str(tmp_path), w)) for w in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a torn write would warn as corrupt
        entry = AutotuneCache(tmp_path).lookup(KEY)
    assert entry is not None and entry.config["i"] == 29
    assert [p.name for p in tmp_path.iterdir()] == [f"{KEY.digest()}.json"]


def test_directory_that_is_a_file_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionError, match="not writable"):
        AutotuneCache(blocker).check_writable()
    assert blocker.read_text() == "not a directory"
