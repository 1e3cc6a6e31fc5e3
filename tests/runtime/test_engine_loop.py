"""The engine thread's hand-over of arrivals: a TTFT estimate made while the scheduler takes a request in (its
prefix-cache lookup, a disk-tier load) still counts that request as queued ahead."""

from __future__ import annotations

import threading

import pytest

import ttftc
from ttftc.llm import GenerationParams
from ttftc.runtime.prefix_cache import PRIVATE

TIMEOUT_S = 60


@pytest.fixture
def llm():
    llm = ttftc.LLM("tiny", precision="fp32", buckets=None, compile_kv_path=False, batch_window_ms=0.0)
    yield llm
    llm.close(drain_timeout_s=5)


def test_an_estimate_during_admission_counts_the_request_being_admitted(llm, monkeypatch):
    engine = llm._engine
    entered, release = threading.Event(), threading.Event()
    start = engine.start

    def slow_start(prompt, **kwargs):  # the scheduler's submit, held inside engine.start
        if len(prompt) == 300:
            entered.set()
            assert release.wait(TIMEOUT_S)
        return start(prompt, **kwargs)

    monkeypatch.setattr(engine, "start", slow_start)
    llm.open([(7 * i + 1) % 500 for i in range(300)], GenerationParams(max_new_tokens=1, ignore_eos=True),
             lambda event: None, tenant=PRIVATE, priority=-1)
    try:
        assert entered.wait(TIMEOUT_S), "the engine thread never took the request in"
        estimate = llm.estimate([1, 2, 3], tenant=PRIVATE, priority=0)
        assert estimate.ahead_tokens > 0, estimate  # without it in the queue, nothing is ahead
    finally:
        release.set()
