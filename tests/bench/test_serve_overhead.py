"""`python -m ttftc.bench.serve_overhead`: the same LLM timed in process and at the socket, every repeat."""

from __future__ import annotations

import pytest

import ttftc
from ttftc.bench.serve_overhead import measure


def test_both_paths_are_timed_on_every_counted_repeat():
    llm = ttftc.LLM("tiny", buckets=None, precision="fp32", compile_kv_path=False)
    try:
        doc = measure(llm, prompt_len=16, repeats=2)
    finally:
        llm.close(drain_timeout_s=5)
    assert len(doc["generate_ttft_ms"]) == len(doc["socket_ttft_ms"]) == 2  # the warm-up round is not counted
    assert doc["generate_ttft_ms_p50"] > 0 and doc["socket_ttft_ms_p50"] > 0
    assert doc["ratio"] == pytest.approx(doc["socket_ttft_ms_p50"] / doc["generate_ttft_ms_p50"])
