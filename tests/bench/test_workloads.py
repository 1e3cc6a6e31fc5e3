"""The workload plug-in interface: registry, replay semantics, and a plug-in running through the harness."""

from __future__ import annotations

import time

import pytest

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


def test_replay_counts_queueing_from_the_arrival_time():
    ctx = WorkloadContext(seq=4, vocab_size=10, seed=0)
    ids = ctx.prompt(4, seed=0)

    def slow_server(request):
        time.sleep(0.05)

    # both arrive at once: the second waits for the first, so its TTFT includes that wait
    ttfts = replay([Request(ids, arrival_s=0.0), Request(ids, arrival_s=0.0)], slow_server)
    assert ttfts[0] >= 0.05 and ttfts[1] >= 0.1
    # back to back: each is timed from its own issue
    ttfts = replay([Request(ids), Request(ids), Request(ids, measured=False)], slow_server)
    assert len(ttfts) == 2 and all(0.05 <= t < 0.1 + 0.5 for t in ttfts)
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
