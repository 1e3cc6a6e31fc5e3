"""SIGTERM on `ttftc serve` (a real subprocess): new connections are refused, the stream in flight finishes, exit 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import urllib.request

import openai

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


def test_sigterm_drains_the_stream_in_flight_then_exits_cleanly():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "ttftc.cli", "serve", "tiny", "--buckets", "none",
                               "--eager-kv-path", "--precision", "fp32", "--port", str(port), "--drain-timeout", "30",
                               "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: healthy(url) or server.poll() is not None, timeout_s=90, what="the server to start")
        assert server.poll() is None, server.communicate()[1]
        client = openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=1500, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        received = [next(chunks)]
        server.send_signal(signal.SIGTERM)
        wait_until(lambda: not healthy(url), timeout_s=10, what="the listener to close")
        received += list(chunks)  # the stream in flight keeps going to its end
        tokens = sum(len(c.choices[0].model_extra.get("token_ids", [])) for c in received if c.choices)
        assert tokens == 1500 and received[-1].choices[0].finish_reason == "length"
        _, err = server.communicate(timeout=60)
        assert server.returncode == 0, err
        assert "stopped (0 requests cut off" in err
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
