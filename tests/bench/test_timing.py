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
