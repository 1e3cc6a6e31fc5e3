"""The Inductor and torchao peers on the tiny preset (slow: Inductor compiles for tens of seconds here)."""

from __future__ import annotations

import importlib.util

import pytest

from ttftc.bench import BenchSettings, run_bench


@pytest.mark.slow
def test_inductor_peers_run_on_tiny():
    variants = ("inductor", "inductor-bf16", "torchao-int8")
    doc = run_bench(BenchSettings(model="tiny", seqs=(16, 32), variants=variants, repeats=2, warmup=1,
                                  peak_size=256, progress=False, first_call="in-process"))
    rows = {(r["variant"], r["seq"]): r for r in doc["results"]}
    for variant in ("inductor", "inductor-bf16"):
        for seq in (16, 32):
            assert rows[(variant, seq)]["status"] == "ok", rows[(variant, seq)]["status"]
    assert rows[("inductor-bf16", 16)]["dtype"] == "bf16"
    torchao = rows[("torchao-int8", 16)]
    if importlib.util.find_spec("torchao") is None:
        assert torchao["status"] == "skipped: torchao not installed"
    else:
        assert torchao["status"] == "ok", torchao["status"]
        assert torchao["dtype"] == "int8" and torchao["ttft_ms_p50"] > 0
