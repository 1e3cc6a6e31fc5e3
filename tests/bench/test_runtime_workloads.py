"""The runtime workloads: the measurement functions and the `ttftc bench` plug-ins.

Timings here come from a virtual clock that advances only inside model forwards, by a fixed cost per forward and
per token: the workloads' claims (a warm prefix is cheaper than a cold one, chunking bounds the decode stall) are
orderings that hold under that cost model exactly, so they are asserted without measuring this machine's speed.
"""

import pytest
import torch

from ttftc import zoo
from ttftc.bench.workloads import WorkloadContext, get_workload, workload_names
from ttftc.bench import runtime_workloads as workloads
from ttftc.runtime.engine import PrefillEngine

FORWARD_S, TOKEN_S = 1e-3, 1e-4  # virtual cost of one forward, and of each token it computes


class VirtualTime:
    """Stands in for the `time` module of ttftc.bench.runtime_workloads."""

    def __init__(self):
        self.now = 0.0
        self.forwards: list[int] = []

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def virtual_time(monkeypatch):
    clock = VirtualTime()
    real_forward = PrefillEngine._forward

    def forward(engine, ids, kv_cache, start):
        clock.now += FORWARD_S + TOKEN_S * len(ids)
        clock.forwards.append(len(ids))
        return real_forward(engine, ids, kv_cache, start)

    monkeypatch.setattr(PrefillEngine, "_forward", forward)
    monkeypatch.setattr(workloads, "time", clock)
    return clock


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


def test_a_warm_prefix_and_a_later_chat_turn_cost_only_their_new_tokens(virtual_time):
    model = zoo.build("llama")
    sp = workloads.shared_prefix(model, prompt_len=48, shared_len=32, repeats=2, block_size=8)
    assert sp.warm_cached_tokens == 32
    # Under the cost model: cold 48 tokens in one forward, warm 16.
    assert sp.cold_s == pytest.approx([FORWARD_S + 48 * TOKEN_S] * 2)
    assert sp.warm_s == pytest.approx([FORWARD_S + 16 * TOKEN_S] * 2)
    assert sp.ratio == pytest.approx((FORWARD_S + 16 * TOKEN_S) / (FORWARD_S + 48 * TOKEN_S))
    ch = workloads.chat(model, turns=3, turn_len=10, reply_len=2, repeats=1)
    assert ch.last_turn_computed_tokens == 11 and ch.history_len == 3 * 10 + 2 * 2
    assert ch.last_turn_s == pytest.approx([FORWARD_S + 11 * TOKEN_S])
    assert ch.cold_s == pytest.approx([FORWARD_S + ch.history_len * TOKEN_S]) and ch.ratio < 1


def test_chunking_bounds_the_decode_stall_and_the_short_prompts_wait(virtual_time):
    model = zoo.build("llama")
    ma = workloads.mixed_arrivals(model, long_len=256, short_len=8, n_short=6, chunk_size=16)
    assert len(ma.chunked.short_ttft_s) == len(ma.unchunked.short_ttft_s) == 6
    assert ma.short_prefill_s == pytest.approx(FORWARD_S + 8 * TOKEN_S)
    assert max(virtual_time.forwards) == 256  # the unchunked arm prefilled the long prompt in one forward
    # Unchunked, the decoding request waits out the whole 256-token forward; chunked, at most a 16-token chunk
    # and the short prompts of that step.
    assert ma.unchunked.decode_stall_s >= FORWARD_S + 256 * TOKEN_S - 1e-12  # (sums of floats)
    assert ma.chunked.decode_stall_s < ma.unchunked.decode_stall_s / 2
    # The short prompts that arrive behind the long one wait for one chunk, not for the whole prompt.
    assert ma.chunked.short_p95_s < ma.unchunked.short_p95_s / 2 and ma.ratio < 0.5
    assert ma.chunked.long_ttft_s > ma.unchunked.long_ttft_s  # what chunking costs: the long prompt finishes later
