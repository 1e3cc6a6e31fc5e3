"""The record of measured CPU choices (codegen/cpu/measured.py) is untrusted data: whatever sits at its path, a
process measures again (with a warning) and goes on, never raising; and a forged record cannot make an inexact
int8 GEMM run."""

from __future__ import annotations

import json
import os
import warnings

import pytest

from tests.codegen.test_int8_gemm_choice import saturating_u8_gemm
from ttftc.codegen.cpu import int8_gemm_choice as policy
from ttftc.codegen.cpu import int8_linear, measured
from ttftc.codegen.cpu.int8_gemm_choice import FP32


@pytest.fixture
def store(tmp_path, monkeypatch):
    path = tmp_path / "machine" / "choices.json"
    path.parent.mkdir()
    monkeypatch.setenv(measured.STORE_ENV, str(path))
    return path


def _valid_record(value, **extra) -> dict:
    key = measured.machine_key()
    return {"schema": 1, "machines": {measured._digest(key): {"key": key, "choices": {
        "x": {"value": value, "measured_at": 1.0, **extra}}}}}


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _sparse(path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


HOSTILE = {
    "not json": lambda p: p.write_bytes(b"\x00\xff not json"),
    "deeply nested": lambda p: p.write_text(_deep(200_000)),
    "deeply nested inside a record": lambda p: p.write_text(json.dumps(_valid_record(0)).replace("0}", _deep(50_000)
                                                                                                 + "}", 1)),
    "sparse 1 TiB": lambda p: _sparse(p, 1 << 40),
    "a directory": lambda p: p.mkdir(),
    "a fifo": lambda p: os.mkfifo(p),
    "a link to /dev/zero": lambda p: p.symlink_to("/dev/zero"),
    "wrong schema": lambda p: p.write_text(json.dumps({"schema": 99, "machines": {}})),
    "machines a list": lambda p: p.write_text(json.dumps({"schema": 1, "machines": []})),
    "a list": lambda p: p.write_text("[]"),
    "value of the wrong type": lambda p: p.write_text(json.dumps(_valid_record("fast"))),
    "NaN time": lambda p: p.write_text(json.dumps(_valid_record({"blas": float("nan")}))),
    "negative time": lambda p: p.write_text(json.dumps(_valid_record({"blas": -1.0}))),
    "boolean time": lambda p: p.write_text(json.dumps(_valid_record({"blas": True}))),
    "unknown candidate": lambda p: p.write_text(json.dumps(_valid_record({"rm -rf": 1.0}))),
    "others_busy a string": lambda p: p.write_text(json.dumps(_valid_record({"blas": 1.0}, others_busy="0"))),
    "others_busy negative": lambda p: p.write_text(json.dumps(_valid_record({"blas": 1.0}, others_busy=-3.0))),
    "others_busy NaN": lambda p: p.write_text(json.dumps(_valid_record({"blas": 1.0}, others_busy=float("nan")))),
    "others_busy a boolean": lambda p: p.write_text(json.dumps(_valid_record({"blas": 1.0}, others_busy=False))),
    "measured_at a string": lambda p: p.write_text(json.dumps(_valid_record({"blas": 1.0})).replace("1.0}}}}",
                                                                                                   '"x"}}}}')),
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_a_hostile_record_is_measured_again_without_an_exception(store, attack):
    HOSTILE[attack](store)
    calls = []

    def measure():
        calls.append(1)
        return {"blas": 2.0}

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        value, provenance = measured.recall("x", measure, dict, lambda raw: measured.checked_times(raw, ("blas",)))
    assert value == {"blas": 2.0} and calls == [1] and not provenance.loaded
    if attack not in ("a directory",):  # the record is replaced whole (a directory at the path cannot be)
        assert not store.is_symlink() and json.loads(store.read_text())["schema"] == 1


def test_a_forged_int8_record_cannot_make_an_inexact_gemm_run():
    # The forger leaves the saturating GEMM out of `refused` and times it fastest.
    candidates = {**int8_linear.GEMMS, "onednn_u8": saturating_u8_gemm}
    forged = {"shape": [256, 1024, 1024], "ms": {FP32: 10.0, "onednn_u8": 0.1}, "refused": {}}
    with pytest.raises(ValueError, match="onednn_u8 is not exact here"):
        policy.decode(forged, candidates, {})


@pytest.mark.parametrize("forged, why", [
    ({"shape": [256, 1024], "ms": {FP32: 1.0}, "refused": {}}, "three positive ints"),
    ({"shape": [256, 1024, True], "ms": {FP32: 1.0}, "refused": {}}, "three positive ints"),
    ({"shape": [1, 1, 1], "ms": {"int_mm": 1.0}, "refused": {}}, "fp32 must be timed"),
    ({"shape": [1, 1, 1], "ms": {FP32: 1.0, "int_mm": 0.5}, "refused": {"int_mm": "x"}}, "both timed and refused"),
    ({"shape": [1, 1, 1], "ms": {FP32: 1.0}, "refused": {"../x": "x"}}, "refused must map"),
    ({"shape": [1, 1, 1], "ms": {FP32: 1.0}, "refused": {"int_mm": 3}}, "refused must map"),
    ([], "JSON object"),
])
def test_a_malformed_int8_record_is_refused_with_its_reason(forged, why):
    with pytest.raises(ValueError, match=why):
        policy.decode(forged, int8_linear.GEMMS, {})


def test_the_store_never_writes_outside_its_path_through_a_planted_link(store, tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("keep")
    store.symlink_to(target)
    measured.recall("x", lambda: {"blas": 1.0}, dict, lambda raw: measured.checked_times(raw, ("blas",)))
    assert target.read_text() == "keep" and not store.is_symlink()
