"""Tuned knobs read from files are points of their autotune space, at every boundary (issue 33, findings 1, 6, 9).

A knob reaches a kernel as a block or buffer size: `native_block_k=2**61` from an artifact or an autotune entry
once corrupted the native attention's scratch memory. Each boundary now refuses a value no tuning run produces.
"""

from __future__ import annotations

import os
import warnings

import pytest

from ttftc.autotune.cache import MAX_ENTRY_BYTES, AutotuneCache, TuneKey
from ttftc.autotune.space import knob_reason, tuning_axes
from ttftc.cache.graph_calls import GraphFormatError, _check_tuning
import ttftc.codegen.providers  # noqa: F401  (importing it registers every lowering and search space)

KEY = TuneKey(device="cpu:test:2 threads", op="attention", provider="cpu", shapes="1x2x16x16:float32",
              dtype="float32")


@pytest.fixture(scope="module")
def attention_axes():
    return tuning_axes("attention", "cpu")


@pytest.mark.parametrize("config, reason", [
    ({"kernel": "native", "native_block_k": 2**61}, "native_block_k=2305843009213693952 is not a value its axis"),
    ({"kernel": "native", "native_block_k": 2**40}, "native_block_k=1099511627776 is not a value its axis"),
    ({"gemm_block_rows": 0}, "gemm_block_rows=0 is not a value its axis"),
    ({"gemm_block_rows": -1}, "gemm_block_rows=-1 is not a value its axis"),
    ({"gemm_block_rows": 10**6}, "gemm_block_rows=1000000 is not a value its axis"),
    ({"gemm_block_rows": 64.0}, "gemm_block_rows=64.0 is not a value its axis"),
    ({"gemm_block_rows": True}, "gemm_block_rows=True is not a value its axis"),
    ({"kernel": "shellcode"}, "kernel='shellcode' is not a value its axis"),
    ({"num_threads": 0}, "num_threads=0 is not an int in [1, 1024]"),
    ({"num_threads": 10**9}, "num_threads=1000000000 is not an int in [1, 1024]"),
    ({"BLOCK_M": 64}, "'BLOCK_M' is not a knob of this lowering's autotune space"),
])
def test_a_knob_outside_its_axis_is_refused(attention_axes, config, reason):
    assert knob_reason(config, attention_axes).startswith(reason)


def test_every_point_of_the_space_and_any_thread_count_pass(attention_axes):
    from ttftc.autotune.space import space_for

    for point in space_for("attention", "cpu").grid():
        assert knob_reason(point, attention_axes) is None, point
    assert knob_reason({"num_threads": 64}, attention_axes) is None  # tuned on a bigger machine
    assert knob_reason({}, attention_axes) is None
    assert knob_reason({"kernel": "flash"}, None).startswith("'kernel' is not a knob")  # no space: nothing passes


def test_a_stored_graph_with_a_huge_block_is_refused_at_decode(attention_axes):
    with pytest.raises(GraphFormatError, match="native_block_k=2305843009213693952 is not a value its axis"):
        _check_tuning({"kernel": "native", "native_block_k": 2**61}, attention_axes, "node 7")
    _check_tuning({"kernel": "native", "native_block_k": 64}, attention_axes, "node 7")


def test_an_autotune_entry_outside_its_space_is_ignored_with_a_warning(tmp_path, attention_axes):
    cache = AutotuneCache(tmp_path)
    cache.store(KEY, {"kernel": "native", "native_block_k": 2**40}, tuned_ms=1.0, default_ms=2.0)
    with pytest.warns(UserWarning, match="outside its autotune space .native_block_k=1099511627776"):
        assert AutotuneCache(tmp_path).lookup(KEY, axes=attention_axes) is None
    cache.store(KEY, {"kernel": "native", "native_block_k": 128}, tuned_ms=1.0, default_ms=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AutotuneCache(tmp_path).lookup(KEY, axes=attention_axes).config["native_block_k"] == 128


@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero", "oversized"])
def test_an_autotune_entry_that_is_no_regular_small_file_is_ignored_without_reading_it(tmp_path, kind):
    path = tmp_path / f"{KEY.digest()}.json"
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading would wait for a writer forever
    elif kind == "symlink to /dev/zero":
        path.symlink_to("/dev/zero")  # reading it would never end
    else:
        path.write_bytes(b" " * (MAX_ENTRY_BYTES + 1))
    with pytest.warns(UserWarning, match="corrupt entry"):
        assert AutotuneCache(tmp_path).lookup(KEY) is None
