"""Start-up with `background_compile=True` (what `ttftc serve` does): a real server answers /health and completions
while its buckets still compile, each bucket switches over once its graph is ready, progress is reported per bucket
and in /metrics, and a bucket whose compile fails leaves the server serving.

Compiles are held back deterministically: `compile_graph` is wrapped so that a bucket's compile waits for the test
to open that bucket's gate (an Event), never for a sleep."""

from __future__ import annotations

import json
import re
import threading
import urllib.request

import openai
import pytest

import ttftc
from ttftc.runtime import background
from ttftc.serve import BackgroundServer, WarmPrompt, create_app
from tests.serve.helpers import metric, wait_until

TIMEOUT_S = 60
GATE_TIMEOUT_S = 120  # a test that never opens a gate fails instead of hanging


class Gates:
    """compile_graph, held at each bucket until `open(bucket)`; `fail` makes a bucket's compile raise instead."""

    def __init__(self, monkeypatch, buckets, fail=()):
        self.events = {b: threading.Event() for b in buckets}
        self.fail = set(fail)
        self.started: list[tuple[int, int]] = []
        real = background.compile_graph

        def gated(prefill, bucket, batch):
            self.started.append((bucket, batch))
            if not self.events[bucket].wait(GATE_TIMEOUT_S):
                raise TimeoutError(f"the test never opened bucket {bucket}")
            if bucket in self.fail:
                raise RuntimeError(f"simulated compile failure of bucket {bucket}")
            real(prefill, bucket, batch)

        monkeypatch.setattr(background, "compile_graph", gated)

    def open(self, bucket):
        self.events[bucket].set()

    def open_all(self):
        for event in self.events.values():
            event.set()


def get(url):
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        return response.status, response.read().decode()


def scrape(server):
    return get(server.url + "/metrics")[1]


def prompt(n, seed=0):
    return [(seed * 131 + 7 * i + 3) % 512 for i in range(n)]


def complete(client, ids, max_tokens=4):
    response = client.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
    return response.choices[0].model_extra["token_ids"]


def start(monkeypatch, fail=()):
    gates = Gates(monkeypatch, (32, 64), fail)
    lines: list[str] = []
    # The KV path stays eager here (tests/test_llm.py switches a compiled one over): see test_server.py's fixture.
    llm = ttftc.LLM("tiny", precision="fp32", buckets=(32, 64), prefill_batch_sizes=(1, 2), prefill_batch_tokens=64,
                    chunked_prefill=None, compile_kv_path=False, background_compile=True, on_progress=lines.append)
    server = BackgroundServer(create_app(llm)).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)
    return gates, lines, llm, server, client


def stop(gates, llm, server):
    gates.open_all()
    server.stop()
    llm.close(drain_timeout_s=TIMEOUT_S)


def test_serves_while_compiling_then_each_bucket_switches_over(monkeypatch):
    gates, lines, llm, server, client = start(monkeypatch)
    try:
        # Nothing compiled yet: healthy, and a completion runs on the KV path.
        status, body = get(server.url + "/health")
        assert status == 200 and json.loads(body) == {"status": "ok", "buckets_compiling": 2, "warm": False}
        text = scrape(server)
        assert metric(text, "ttftc_buckets_compiling") == 2 and metric(text, "ttftc_buckets_compiled") == 0
        short, longer = prompt(20, seed=1), prompt(50, seed=2)
        paths = llm._scheduler.cost_model.paths  # what the TTFT estimate fits apart
        assert paths.prefill(20, 0) == ("kv", "eager", "compiling") and paths.volatile(paths.prefill(20, 0))
        eager_short, eager_longer = complete(client, short), complete(client, longer)
        assert llm._engine.bucketed_prompts == 0 and metric(scrape(server), "ttftc_bucketed_prefill_prompts") == 0

        gates.open(32)
        wait_until(lambda: lines, GATE_TIMEOUT_S, "bucket 32's progress line")
        assert re.fullmatch(r"bucket 32 (compiled|loaded) in \d+\.\d s \(1/2\)", lines[0]), lines
        assert complete(client, short) == eager_short
        assert llm._engine.bucketed_prompts == 1, "a prompt of bucket 32 runs in its graph once it is compiled"
        assert paths.prefill(20, 0) == ("bucket", "compiling") and paths.prefill(50, 0)[0] == "kv"
        assert paths.prefill(20, 4)[0] == "kv", "a prompt with a cached prefix runs on the KV path"
        assert complete(client, longer) == eager_longer
        assert llm._engine.bucketed_prompts == 1, "bucket 64 is still compiling: its prompt took the KV path"
        text = scrape(server)
        assert metric(text, "ttftc_buckets_compiling") == 1 and metric(text, "ttftc_buckets_compiled") == 1
        assert metric(text, "ttftc_bucketed_prefill_prompts") == 1
        assert json.loads(get(server.url + "/health")[1])["buckets_compiling"] == 1

        gates.open(64)
        assert llm._compiler.done.wait(GATE_TIMEOUT_S), "the compile ends"
        assert re.fullmatch(r"bucket 64 (compiled|loaded) in \d+\.\d s \(2/2\)", lines[1]), lines
        assert re.fullmatch(r"bucket 32 batch sizes 2 (compiled|loaded) in \d+\.\d s", lines[2]), lines
        assert complete(client, longer) == eager_longer and llm._engine.bucketed_prompts == 2
        text = scrape(server)
        assert metric(text, "ttftc_buckets_compiling") == 0 and metric(text, "ttftc_buckets_compiled") == 2
        assert metric(text, "ttftc_buckets_failed") == 0 and metric(text, "ttftc_kv_path_compiled") == 0
        assert metric(text, "ttftc_warm") == 1 and json.loads(get(server.url + "/health")[1])["warm"] is True
        assert paths.prefill(50, 0) == ("bucket", "warm") and not paths.volatile(paths.prefill(50, 0))
        assert metric(text, "ttftc_graph_compiles_total") + metric(text, "ttftc_graph_cache_loads_total") == 3
        # every bucket's batch-1 graph first (it makes the bucket usable), then the batched ones
        assert gates.started == [(32, 1), (64, 1), (32, 2)], "64 x 2 is over the 64-token batch cap"
        assert llm._engine.ready_batches == {32: (2, 1), 64: (1,)}
    finally:
        stop(gates, llm, server)


def test_a_failed_bucket_compile_keeps_the_server_serving(monkeypatch):
    gates, lines, llm, server, client = start(monkeypatch, fail=(32,))
    try:
        gates.open_all()
        assert llm._compiler.done.wait(GATE_TIMEOUT_S), "the compile ends"
        assert any(line.startswith("bucket 32 failed to compile") and "simulated compile failure" in line
                   for line in lines), lines
        assert any(note.startswith("bucket 32 failed to compile") for note in llm.notes)
        text = scrape(server)
        assert metric(text, "ttftc_buckets_failed") == 1 and metric(text, "ttftc_buckets_compiled") == 1
        assert len(complete(client, prompt(20))) == 4, "bucket 32's prompts run on the KV path"
        assert llm._engine.bucketed_prompts == 0
        assert len(complete(client, prompt(50))) == 4 and llm._engine.bucketed_prompts == 1
        assert get(server.url + "/health")[0] == 200
    finally:
        stop(gates, llm, server)


def test_shutdown_while_a_bucket_compiles_waits_for_that_graph_and_starts_no_other(monkeypatch):
    gates, lines, llm, server, client = start(monkeypatch)
    wait_until(lambda: gates.started, GATE_TIMEOUT_S, "the first compile to start")
    server.stop()
    closer = threading.Thread(target=llm.close, kwargs={"drain_timeout_s": 0})
    with pytest.warns(UserWarning, match="waiting for the background compile") as record:
        closer.start()
        wait_until(lambda: len(record), TIMEOUT_S, "close to wait for the compile")
        assert not llm._loop._thread.is_alive(), "the engine stopped first"
        assert closer.is_alive(), "close waits for the graph in hand (a process exiting mid-compile aborts)"
        gates.open_all()
        closer.join(TIMEOUT_S)
    assert not closer.is_alive() and llm._compiler.done.is_set()
    assert gates.started == [(32, 1)], "no graph is started after close"


def test_warm_prompts_are_prefilled_on_the_kv_path_while_the_buckets_compile(monkeypatch):
    gates = Gates(monkeypatch, (32, 64))
    llm = ttftc.LLM("tiny", precision="fp32", buckets=(32, 64), prefill_batch_sizes=(1,), chunked_prefill=None,
                    compile_kv_path=False, background_compile=True)
    warm = prompt(40, seed=5)
    try:
        app = create_app(llm, tenant_header="X-Tenant", warm=[WarmPrompt(tuple(warm), tenant="acme")])
        assert app.state.served.warmed.tokens > 0 and llm.compile_status()["buckets_compiling"] == 2
        with BackgroundServer(app) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S,
                                   default_headers={"X-Tenant": "acme"})
            response = client.completions.create(model="tiny", prompt=warm + prompt(5, seed=6), max_tokens=2,
                                                 temperature=0)
            assert response.usage.prompt_tokens_details.cached_tokens > 0, "the warm prompt hit on the first request"
    finally:
        gates.open_all()
        llm.close(drain_timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("flags, background_compile", [([], True), (["--compile-before-ready"], False)])
def test_serve_compiles_in_the_background_unless_told_to_compile_before_ready(monkeypatch, capsys, flags,
                                                                                background_compile):
    from types import SimpleNamespace

    import ttftc.llm
    import ttftc.serve
    from ttftc.cli import main

    calls = []

    def fake_llm(*args, **kwargs):
        calls.append(kwargs)
        kwargs["on_progress"]("bucket 32 compiled in 1.0 s (1/7)")
        return SimpleNamespace(name="tiny", notes=[])

    monkeypatch.setattr(ttftc.llm, "LLM", fake_llm)
    monkeypatch.setattr(ttftc.serve, "create_app", lambda llm, **kwargs: "app")
    monkeypatch.setattr(ttftc.serve, "run_server", lambda app, **kwargs: 0)
    assert main(["serve", "tiny", *flags]) == 0
    assert [call["background_compile"] for call in calls] == [background_compile]
    assert "ttftc serve: bucket 32 compiled in 1.0 s (1/7)" in capsys.readouterr().err
