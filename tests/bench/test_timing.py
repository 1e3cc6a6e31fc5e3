from __future__ import annotations

import pytest

from ttftc.bench.timing import percentile, summarize_ms


def test_percentile_interpolates_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 95) == pytest.approx(4.8)  # rank 3.8 between 4 and 5
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_is_in_milliseconds():
    summary = summarize_ms([0.010, 0.020, 0.030])
    assert summary["ttft_ms_p50"] == pytest.approx(20.0)
    assert summary["ttft_ms_min"] == pytest.approx(10.0)
    assert summary["ttft_ms_mean"] == pytest.approx(20.0)
    assert summary["ttft_ms_p50"] <= summary["ttft_ms_p95"] <= summary["ttft_ms_p99"] <= 30.0


class _FakeEvent:
    """A CUDA event on a fake GPU clock that the test advances by hand."""

    clock_ms = 0.0
    records: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing, "an event without timing cannot give elapsed_time"
        self.at_ms = None

    def record(self):
        self.at_ms = _FakeEvent.clock_ms
        _FakeEvent.records.append(self)

    def synchronize(self):
        assert self.at_ms is not None, "waited on an event that was never recorded"

    def elapsed_time(self, end):
        return end.at_ms - self.at_ms


@pytest.fixture
def fake_cuda(monkeypatch):
    import torch

    _FakeEvent.clock_ms, _FakeEvent.records = 0.0, []
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    return syncs


def test_cuda_time_is_the_gpu_clock_between_two_events(fake_cuda):
    from ttftc.bench.timing import CUDA_EVENTS, DeviceClock, time_call

    def work():  # 12.5 ms of GPU time, whatever the host clock says
        _FakeEvent.clock_ms += 12.5

    assert time_call(work, device="cuda") == pytest.approx(0.0125)
    assert len(_FakeEvent.records) == 2 and fake_cuda, "two events, and the device drained before the first"
    clock = DeviceClock("cuda:0")
    assert clock.uses_cuda_events and clock.name == CUDA_EVENTS


def test_cpu_time_is_the_wall_clock(monkeypatch):
    import time

    from ttftc.bench import timing

    now = iter([100.0, 100.25])
    monkeypatch.setattr(time, "perf_counter", lambda: next(now))
    clock = timing.DeviceClock("cpu")
    assert not clock.uses_cuda_events and clock.name == timing.WALL_CLOCK
    assert timing.time_call(lambda: None, device="cpu") == pytest.approx(0.25)
