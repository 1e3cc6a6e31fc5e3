"""A restart on a warm compile cache compiles nothing: every bucket graph (batched ones included) and every graph of
the compiled KV path is loaded, the progress lines say "loaded", /metrics counts loads and no compiles, and /health
says warm once all are in place.

The in-process test leaves the KV path eager (two LLMs in one process share Dynamo's compiled code, so the second
would not even ask for its KV graphs); the `ttftc serve` test runs with the default flags, the compiled KV path
included: Dynamo traces it again in the second process, and ttftc's backend loads each graph it hands over
(tests/cache/test_kv_graph_cache.py checks those graphs' logits)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import ttftc
from ttftc.runtime.ttft_estimate import CostModel, ForwardPaths
from tests.serve.helpers import metric

START_TIMEOUT_S = 900  # a busy 2-core machine compiles slowly; this bounds a hang, it is not a time budget
BUCKETS = (32, 64)


def start_llm(lines):
    return ttftc.LLM("tiny", precision="fp32", buckets=BUCKETS, prefill_batch_sizes=(1, 2), prefill_batch_tokens=64,
                     chunked_prefill=None, compile_kv_path=False, background_compile=True, on_progress=lines.append)


def test_a_second_llm_on_the_same_cache_loads_every_graph_and_compiles_none(monkeypatch, tmp_path):
    monkeypatch.setenv("TTFTC_COMPILE_CACHE", str(tmp_path / "compile"))
    counts = []
    for start in ("first", "second"):
        lines: list[str] = []
        llm = start_llm(lines)
        try:
            assert llm._compiler.done.wait(START_TIMEOUT_S), f"the {start} start's background compile ends"
            status = llm.compile_status()
            assert status["warm"] and status["buckets_failed"] == 0, (status, llm.notes)
            counts.append((status["graphs_compiled"], status["graphs_loaded"], lines))
        finally:
            llm.close(drain_timeout_s=30)
    (first_compiled, first_loaded, first_lines), (second_compiled, second_loaded, second_lines) = counts
    # 32 x 1, 64 x 1 and 32 x 2 (64 x 2 is over the 64-token batch cap)
    assert (first_compiled, first_loaded) == (3, 0), first_lines
    assert (second_compiled, second_loaded) == (0, 3), second_lines
    # one line per bucket, then one for bucket 32's batch size 2
    assert len(first_lines) == len(second_lines) == 3, (first_lines, second_lines)
    assert all(" compiled in " in line for line in first_lines), first_lines
    assert all(" loaded in " in line for line in second_lines), second_lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def serve_until_warm(cache_dir, log_path) -> str:
    """Start `ttftc serve tiny`, wait until /health says warm, return /metrics' text, and stop the server cleanly."""
    port = free_port()
    env = {**os.environ, "TTFTC_COMPILE_CACHE": str(cache_dir)}
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "ttftc.cli", "serve", "tiny", "--port", str(port), "--precision", "fp32",
             "--buckets", ",".join(map(str, BUCKETS)), "--threads", "1"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert server.poll() is None, f"ttftc serve exited early:\n{log_path.read_text()}"
            try:
                if json.loads(get(f"http://127.0.0.1:{port}/health")).get("warm"):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet
            assert time.monotonic() < deadline, f"ttftc serve never said warm:\n{log_path.read_text()}"
            time.sleep(0.2)
        return get(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            assert server.wait(120) == 0, f"ttftc serve did not stop cleanly:\n{log_path.read_text()}"
        finally:
            if server.poll() is None:
                server.kill()


@pytest.mark.slow
def test_a_second_ttftc_serve_on_the_same_cache_compiles_nothing(tmp_path):
    cache = tmp_path / "compile"
    first = serve_until_warm(cache, tmp_path / "first.log")
    compiled = metric(first, "ttftc_graph_compiles_total")
    assert compiled > 0 and metric(first, "ttftc_graph_cache_loads_total") == 0, first
    second = serve_until_warm(cache, tmp_path / "second.log")
    assert metric(second, "ttftc_graph_compiles_total") == 0, (tmp_path / "second.log").read_text()
    assert metric(second, "ttftc_graph_cache_loads_total") == compiled
    assert metric(second, "ttftc_warm") == 1
    log = (tmp_path / "second.log").read_text()
    assert "bucket 32 loaded in" in log and "bucket 64 loaded in" in log and " compiled in " not in log, log
    assert "KV path loaded in" in log and "(0 graphs compiled, " in log, log
    first_log = (tmp_path / "first.log").read_text()
    assert "KV path compiled in" in first_log and ", 0 loaded from the compile cache)" in first_log, first_log


class Server:
    """Which path each forward runs on, as a warming server switches: a bucket becomes ready, then the compile ends."""

    def __init__(self):
        self.bucket_ready = False
        self.compiling = True

    def state(self):
        return "compiling" if self.compiling else "warm"

    def paths(self) -> ForwardPaths:
        return ForwardPaths(prefill=lambda n, ctx: ("bucket" if self.bucket_ready and ctx == 0 else "kv", self.state()),
                            decode=lambda: ("kv", self.state()), volatile=lambda path: path[-1] == "compiling")


def test_the_estimate_uses_each_paths_own_forwards_not_a_fit_of_the_slower_path_it_left():
    server = Server()
    model = CostModel(paths=server.paths())
    for _ in range(20):  # the eager path, sharing the CPU with a compile
        model.observe_prefill([(100, 0)], 0.8)
    assert model.prefill_s(100, 0) > 0.5
    server.bucket_ready = True
    model.observe_prefill([(100, 0)], 0.02)  # the first forward in the bucket's graph
    assert model.prefill_s(100, 0) < 0.04, "one forward on the new path is what it predicts from"
    assert model.prefill_s(100, 10) > 0.5, "a prompt with a cached prefix still runs on the slow KV path"
    server.compiling = False
    model.observe_prefill([(100, 0)], 0.01)
    assert model.prefill_s(100, 0) < 0.02, "once warm, the forwards of the compile's time are not averaged in"


def test_while_compiling_the_fit_follows_the_last_few_forwards_and_once_warm_it_averages_many():
    server = Server()
    slow_then_fast = [0.8] * 20 + [0.02] * 3  # the compile thread holds the CPU, then leaves it
    model = CostModel(paths=server.paths())
    for seconds in slow_then_fast:
        model.observe_prefill([(100, 0)], seconds)
    assert model.prefill_s(100, 0) < 0.2, "three forwards on a volatile path outweigh the twenty before them"
    server.compiling = False
    warm = CostModel(paths=server.paths())
    for seconds in slow_then_fast:
        warm.observe_prefill([(100, 0)], seconds)
    assert warm.prefill_s(100, 0) > 0.5, "one odd stretch of forwards does not swing a warm path's fit"
