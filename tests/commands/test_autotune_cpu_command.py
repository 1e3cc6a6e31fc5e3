"""`ttftc autotune --cpu` measures this machine's CPU choices again and overwrites their stored record."""

from __future__ import annotations

import json

from ttftc.cli import main
from ttftc.codegen.cpu import _blas, int8_linear, measured


def test_autotune_cpu_forgets_the_record_measures_every_choice_and_stores_it(tmp_path, monkeypatch, capsys):
    store = tmp_path / "choices.json"
    monkeypatch.setenv(measured.STORE_ENV, str(store))
    monkeypatch.delenv(_blas.GEMM_BACKEND_ENV, raising=False)
    monkeypatch.delenv(int8_linear.INT8_GEMM_ENV, raising=False)
    decode = lambda raw: measured.checked_times(raw, ("blas",))  # noqa: E731
    measured.recall("stale", lambda: {"blas": 1.0}, dict, decode)  # a choice measured before: forgotten
    assert main(["autotune", "--cpu"]) == 0
    out = capsys.readouterr().out
    for line in ("int8 GEMM: ", "fp32 GEMM: ", "fp32 decode GEMM: ", "fp32 attention: ", "bf16 attention: "):
        assert line in out
    assert "loaded from" not in out and f"stored: {store}" in out
    choices = json.loads(store.read_text())["machines"][measured._digest(measured.machine_key())]["choices"]
    assert "stale" not in choices and {"int8_gemm", "gemm_backend:float32", "decode_gemm:float32",
                                       "attention:float32", "attention:bfloat16"} <= set(choices)


def test_autotune_without_a_model_still_needs_one_unless_cpu_or_show(capsys):
    assert main(["autotune"]) == 2
    assert "MODEL is required" in capsys.readouterr().err
