"""The bench on CUDA without a GPU: TTFTs from CUDA events (a fake event clock), the GPU peers, the published bound."""

from __future__ import annotations

import pytest
import torch

from tests.bench.test_timing import _FakeEvent, fake_cuda  # noqa: F401  (fixture)
from ttftc.bench import runner
from ttftc.bench import variants as variants_module
from ttftc.bench.workloads import Request, get_workload


def _server(gpu_ms: list[float]):
    """A server whose every request takes the next of `gpu_ms` on the fake GPU clock."""
    pending = iter(gpu_ms)

    def serve(request):
        _FakeEvent.clock_ms += next(pending)

    return serve


def test_measured_requests_are_timed_with_cuda_events(fake_cuda):  # noqa: F811
    ids = torch.zeros(1, 4, dtype=torch.long)
    requests = [Request(ids), Request(ids, measured=False), Request(ids)]
    ttfts = runner._replay(get_workload("single-prompt"), requests, _server([1.0, 2.0, 4.0]), "cuda")
    assert ttfts == pytest.approx([0.001, 0.004])  # the set-up request's 2 ms is not reported
    assert len(_FakeEvent.records) == 6


def test_arrival_times_keep_the_host_clock(fake_cuda):  # noqa: F811
    ids = torch.zeros(1, 4, dtype=torch.long)
    requests = [Request(ids, arrival_s=0.0), Request(ids, arrival_s=0.0)]
    ttfts = runner._replay(get_workload("single-prompt"), requests, _server([1.0, 1.0]), "cuda")
    assert len(ttfts) == 2 and not _FakeEvent.records, "queueing is only visible on the host clock"


def test_a_workload_with_its_own_replay_keeps_its_clock(monkeypatch, fake_cuda):  # noqa: F811
    workload = get_workload("batch")
    seen = []
    monkeypatch.setattr(type(workload), "replay", lambda self, requests, server, *, device: seen.append(server) or [])
    server = object()
    runner._replay(workload, [Request(torch.zeros(1, 4, dtype=torch.long))], server, "cuda")
    assert seen == [server], "its own server object, not a wrapper it cannot recognise"


def test_cpu_runs_keep_the_workloads_replay(monkeypatch):
    workload = get_workload("single-prompt")
    calls = []
    monkeypatch.setattr(type(workload), "replay",
                        lambda self, requests, server, *, device: calls.append(device) or [0.5])
    assert runner._replay(workload, [], lambda r: None, "cpu") == [0.5] and calls == ["cpu"]


def test_max_autotune_peers_compile_in_that_mode_and_mark_each_prefill_a_new_step(monkeypatch):
    compiled_with, steps = [], []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled_with.append((model, kw)) or model)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    instances = []

    class Source:
        def instance(self, *, attn="sdpa", dtype=torch.float32):
            instances.append(dtype)
            return lambda **kw: kw["input_ids"].sum()

    for name, dtype in (("inductor-max-autotune", torch.float32), ("inductor-max-autotune-bf16", torch.bfloat16)):
        variant = variants_module.get_variant(name)
        built = variant.build(Source())
        assert variant.compiles and compiled_with[-1][1] == {"mode": "max-autotune"} and instances[-1] == dtype
        built.prefill(torch.ones(1, 3, dtype=torch.long))
        built.prefill(torch.ones(1, 3, dtype=torch.long))
    assert len(steps) == 4
    assert variants_module.get_variant("inductor-max-autotune-bf16").dtype == "bf16"


def test_gpu_peers_are_asked_for_by_name():
    for name in ("eager-sdpa-bf16", "inductor-max-autotune", "inductor-max-autotune-bf16"):
        assert name in variants_module.VARIANTS and name not in variants_module.DEFAULT_VARIANTS


def test_the_published_bound_applies_only_to_a_known_gpu(monkeypatch):
    monkeypatch.setattr(runner, "_device_name", lambda device: "NVIDIA H200")
    assert runner._published_device("cuda").key == "h200"
    assert runner._published_device("cpu") is None
    monkeypatch.setattr(runner, "_device_name", lambda device: "NVIDIA GeForce RTX 4090")
    assert runner._published_device("cuda") is None
