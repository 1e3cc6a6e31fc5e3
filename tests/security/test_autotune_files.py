"""Issue 33, finding 6: the autotune cache reads only regular files of entry size, through the compile cache's
reader (ttftc/confined.py: read_regular). A FIFO named x.json hung `ttftc compile` (the compile cache hashes every
autotune entry into its keys), and a symlink to /dev/zero was read until MemoryError.
"""

from __future__ import annotations

import os
import threading
import warnings

import pytest

from ttftc.autotune.cache import MAX_ENTRY_BYTES, AutotuneCache, TuneKey

KEY = TuneKey(device="cpu:test:2 threads", op="attention", provider="cpu", shapes="1x2x16x16:float32",
              dtype="float32")


def _plant(directory, kind: str) -> None:
    path = directory / "x.json"
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading waits for a writer forever
    elif kind == "symlink to /dev/zero":
        path.symlink_to("/dev/zero")  # reading it never ends
    elif kind == "symlink to an entry":
        path.symlink_to(directory / f"{KEY.digest()}.json")
    else:
        path.write_bytes(b" " * (MAX_ENTRY_BYTES + 1))


def _within(seconds: float, call):
    """call() in a daemon thread; fails (rather than hanging the suite) when it has not returned in time."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still reading after {seconds} s"
    return result["value"]


KINDS = ["fifo", "symlink to /dev/zero", "symlink to an entry", "oversized"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_content_digest_skips_what_is_no_entry_without_reading_it(tmp_path, kind):
    cache = AutotuneCache(tmp_path)
    cache.store(KEY, {"kernel": "flash"}, 1.0, 2.0)
    clean = cache.content_digest()
    _plant(tmp_path, kind)
    assert _within(30, cache.content_digest) == clean


@pytest.mark.parametrize("kind", KINDS)
def test_listing_entries_skips_what_is_no_entry_with_one_warning(tmp_path, kind):
    AutotuneCache(tmp_path).store(KEY, {"kernel": "flash"}, 1.0, 2.0)
    _plant(tmp_path, kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entries = _within(30, lambda: list(AutotuneCache(tmp_path).entries()))
    assert [entry.key for entry in entries] == [KEY]
    assert len(caught) == 1 and "x.json" in str(caught[0].message)
