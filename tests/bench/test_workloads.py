"""The workload plug-in interface: registry, replay semantics, and a plug-in running through the harness."""

from __future__ import annotations

import importlib

import pytest
import torch

from ttftc.bench import BenchSettings, run_bench
from ttftc.bench.workloads import (
    DEFAULT_WORKLOAD,
    Request,
    Workload,
    WorkloadContext,
    get_workload,
    register_workload,
    registry,
    replay,
    workload_names,
)


def test_the_single_prompt_workload_is_registered():
    assert DEFAULT_WORKLOAD in workload_names()
    (request,) = get_workload(DEFAULT_WORKLOAD).requests(WorkloadContext(seq=12, vocab_size=50, seed=3))
    assert request.ids.shape == (1, 12) and request.arrival_s is None
    # the same prompt in every repeat, whatever the seed
    (again,) = get_workload(DEFAULT_WORKLOAD).requests(WorkloadContext(seq=12, vocab_size=50, seed=4))
    assert (request.ids == again.ids).all()


class _VirtualTime:
    """Stands in for the `time` module of the replay: sleeping (the server's work, the idle wait) moves it."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_replay_counts_queueing_from_the_arrival_time(monkeypatch):
    clock = _VirtualTime()
    monkeypatch.setattr(importlib.import_module("ttftc.bench.workloads.replay"), "time", clock)
    ctx = WorkloadContext(seq=4, vocab_size=10, seed=0)
    ids = ctx.prompt(4, seed=0)

    def slow_server(request):
        clock.sleep(0.05)

    # both arrive at once: the second waits for the first, so its TTFT includes that wait
    ttfts = replay([Request(ids, arrival_s=0.0), Request(ids, arrival_s=0.0)], slow_server)
    assert ttfts == pytest.approx([0.05, 0.10])
    # an arrival after the server went idle: the idle time is waited out and not counted
    ttfts = replay([Request(ids, arrival_s=0.0), Request(ids, arrival_s=0.2), Request(ids, arrival_s=0.22)],
                   slow_server)
    assert ttfts == pytest.approx([0.05, 0.05, 0.08])
    # back to back: each is timed from its own issue, not from the start of the run
    ttfts = replay([Request(ids), Request(ids), Request(ids, measured=False)], slow_server)
    assert ttfts == pytest.approx([0.05, 0.05])
    with pytest.raises(ValueError, match="all of its requests or to none"):
        replay([Request(ids, arrival_s=0.0), Request(ids)], slow_server)


def test_a_plugged_in_workload_runs_through_the_harness(monkeypatch):
    monkeypatch.setattr(registry, "_WORKLOADS", dict(registry._WORKLOADS))
    servers_made = []

    @register_workload
    class TwoUsers(Workload):
        name = "two-users-test"
        description = "two prompts per run, one a set-up request that is not measured"

        def requests(self, ctx):
            return [Request(ctx.prompt(ctx.seq, seed=1), measured=False), Request(ctx.prompt(ctx.seq, seed=2))]

        def make_server(self, target):
            servers_made.append(target.variant)
            return lambda request: target.model(input_ids=request.ids, logits_to_keep=1)

    doc = run_bench(BenchSettings(model="tiny", seqs=(8,), variants=("eager-sdpa",), repeats=3, warmup=1,
                                  workload="two-users-test", peak_size=256, progress=False, first_call="skip"))
    (row,) = doc["results"]
    assert row["status"] == "ok" and row["workload"] == "two-users-test"
    assert row["samples"] == 3  # one measured request per run
    assert servers_made == ["eager-sdpa"] * 4  # a fresh server for the warm-up and for every repeat


def test_registering_a_non_workload_fails():
    with pytest.raises(TypeError):
        register_workload(object)


def test_the_batch_workload_tables_ttft_per_batch_size():
    from ttftc.bench import report
    from ttftc.bench.workloads.batch import BATCH_SIZES

    requests = get_workload("batch").requests(WorkloadContext(seq=6, vocab_size=50, seed=1))
    assert [r.ids.shape for r in requests] == [(b, 6) for b in BATCH_SIZES]
    assert not torch.equal(requests[1].ids[0], requests[1].ids[1]), "each row of a batch is its own prompt"
    doc = run_bench(BenchSettings(model="tiny", seqs=(8,), variants=("eager-sdpa",), repeats=2, warmup=1,
                                  workload="batch", peak_size=256, progress=False, first_call="skip"))
    (row,) = doc["results"]
    assert row["status"] == "ok" and row["samples"] == 2  # the row is batch 1: one TTFT per repeat
    table = doc["workload_table"]
    assert table["kind"] == "batch" and [r["batch"] for r in table["rows"]] == list(BATCH_SIZES)
    for entry in table["rows"]:
        assert entry["variant"] == "eager-sdpa" and entry["seq"] == 8
        assert entry["samples"] == 2, "the warm-up run of each batch size is not counted"
        assert entry["ms_per_prompt_p50"] == pytest.approx(entry["ttft_ms_p50"] / entry["batch"])
    assert "workload table (batch)" in "\n".join(report.summary_lines(doc))
    assert "## Workload table (batch)" in report.markdown(doc)
