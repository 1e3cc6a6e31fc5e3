"""The runtime workloads: the measurement functions and the `ttftc bench` plug-ins (shapes, not speed)."""

import torch

from ttftc import zoo
from ttftc.bench.workloads import WorkloadContext, get_workload, workload_names
from ttftc.runtime import workloads


def test_plugins_are_registered_and_shaped():
    names = set(workload_names())
    assert {"shared-prefix", "shared-prefix-cold", "chat", "chat-cold", "mixed-arrivals",
            "mixed-arrivals-unchunked"} <= names
    ctx = WorkloadContext(seq=64, vocab_size=100, seed=0)
    shared = get_workload("shared-prefix").requests(ctx)
    assert not shared[0].measured and all(r.measured for r in shared[1:])
    assert all(torch.equal(r.ids[:, :48], shared[0].ids[:, :48]) for r in shared)
    assert len({r.session for r in get_workload("shared-prefix-cold").requests(ctx)}) == len(shared)
    chat = get_workload("chat").requests(ctx)
    assert [r.measured for r in chat] == [False, False, False, True]
    assert all(torch.equal(b.ids[:, :a.ids.shape[1]], a.ids) for a, b in zip(chat, chat[1:]))
    assert torch.equal(get_workload("chat-cold").requests(ctx)[0].ids, chat[-1].ids)
    arrivals = get_workload("mixed-arrivals").requests(ctx)
    assert [r.arrival_s for r in arrivals] == sorted(r.arrival_s for r in arrivals)
    assert sum(r.ids.shape[1] == 64 and not r.measured for r in arrivals) == 1


def test_measurement_functions_run_and_reuse():
    model = zoo.build("llama")
    sp = workloads.shared_prefix(model, prompt_len=48, shared_len=32, repeats=1, block_size=8)
    assert sp.warm_cached_tokens == 32 and sp.ratio > 0
    ch = workloads.chat(model, turns=3, turn_len=10, reply_len=2, repeats=1)
    assert ch.last_turn_computed_tokens == 11 and ch.history_len == 3 * 10 + 2 * 2
    ma = workloads.mixed_arrivals(model, long_len=64, short_len=8, n_short=4, chunk_size=16)
    assert len(ma.chunked.short_ttft_s) == len(ma.unchunked.short_ttft_s) == 4
    assert ma.chunked.decode_stall_s > 0 and ma.unchunked.decode_stall_s > 0
