"""SIGTERM on `ttftc serve` (a real subprocess): new connections are refused, the stream in flight finishes, exit 0;
and a stream the drain timeout cuts off ends cleanly, counted in what the server reports.

The drain timeout is wall-clock time and a stream's length is work: a test that wants the stream to finish gives
the drain a ceiling no machine's stream reaches (it returns as soon as the stream ends), and the test that wants
it cut gives it none. (Issue 40: with 1500 tokens under a 30 s drain, a loaded AVX2 machine ran out of drain; the
cut then dropped the connection mid-chunk and the server reported "0 requests cut off".)
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import urllib.request

import openai
import pytest

from tests.serve.helpers import wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def serve(port: int, drain_timeout_s: str) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "ttftc.cli", "serve", "tiny", "--buckets", "none",
                               "--eager-kv-path", "--precision", "fp32", "--port", str(port), "--drain-timeout",
                               drain_timeout_s, "--log-level", "warning"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: healthy(url) or server.poll() is not None, timeout_s=90, what="the server to start")
    assert server.poll() is None, server.communicate()[1]
    return server


def stream_then_sigterm(server: subprocess.Popen, port: int, max_tokens: int):
    """A stream of `max_tokens`, SIGTERM once its first chunk arrived, then its chunks as they come (an iterator)."""
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=600)
    stream = client.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    server.send_signal(signal.SIGTERM)
    wait_until(lambda: not healthy(url), timeout_s=30, what="the listener to close")
    return first, chunks


def stop(server: subprocess.Popen) -> str:
    _, err = server.communicate(timeout=120)
    assert server.returncode == 0, err
    return err


def test_sigterm_drains_the_stream_in_flight_then_exits_cleanly():
    port = free_port()
    server = serve(port, drain_timeout_s="3600")  # a ceiling, never a budget: the stream must not race it
    try:
        first, chunks = stream_then_sigterm(server, port, max_tokens=300)
        received = [first, *chunks]  # the stream in flight keeps going to its end
        tokens = sum(len(c.choices[0].model_extra.get("token_ids", [])) for c in received if c.choices)
        assert tokens == 300 and received[-1].choices[0].finish_reason == "length"
        assert "stopped (0 requests cut off" in stop(server)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()


def test_a_stream_the_drain_timeout_cuts_off_ends_with_an_error_event_and_is_counted():
    port = free_port()
    server = serve(port, drain_timeout_s="0")  # cut at once: 1500 tokens take far longer than the drain's 0.1 s tick
    try:
        first, chunks = stream_then_sigterm(server, port, max_tokens=1500)
        with pytest.raises(openai.APIError, match="drain timeout ended this request"):
            list(chunks)  # an error event, not a connection dropped mid-chunk (httpx.RemoteProtocolError)
        assert "stopped (1 requests cut off" in stop(server)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
