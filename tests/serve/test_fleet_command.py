"""`ttftc serve --replicas N` from the command line: its flags reach the fleet, it refuses what makes no sense, and
(with Ray installed) the real command serves, then stops its cluster on SIGTERM."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from types import SimpleNamespace

import pytest

import ttftc.llm
from ttftc.cli import main
from ttftc.commands import serve_fleet

HAS_RAY = importlib.util.find_spec("ray") is not None


@pytest.fixture
def fleets(monkeypatch):
    """The specs the command starts fleets with; no Ray, no model."""
    started = []

    class FakeFleet:
        def __init__(self, spec, **where):
            started.append((spec, where))
            self.url = f"http://{where['host']}:{where['port']}"

    monkeypatch.setattr(serve_fleet, "_MISSING", None)
    monkeypatch.setattr(serve_fleet, "Fleet", FakeFleet)
    monkeypatch.setattr(serve_fleet, "FleetSpec",
                        lambda model, replicas, **kwargs: SimpleNamespace(model=model, replicas=replicas, **kwargs))
    monkeypatch.setattr(serve_fleet, "serve_until_signalled", lambda fleet: None)
    monkeypatch.setattr(ttftc.llm, "LLM", lambda *a, **k: pytest.fail("a fleet loads its model in its replicas"))
    return started


def test_the_fleet_flags_reach_the_fleet(fleets):
    assert main(["serve", "tiny", "--replicas", "3", "--routing", "balanced", "--ray-address", "10.0.0.5:6379",
                 "--threads", "2", "--tenant-header", "X-Tenant", "--buckets", "none", "--port", "9000"]) == 0
    ((spec, where),) = fleets
    assert (spec.model, spec.replicas, spec.threads_per_replica, spec.routing.routing) == ("tiny", 3, 2, "balanced")
    assert spec.llm_kwargs["buckets"] is None and spec.app_kwargs["tenant_header"] == "X-Tenant"
    assert where == {"host": "127.0.0.1", "port": 9000, "ray_address": "10.0.0.5:6379"}


def test_prefix_routing_is_the_default(fleets):
    assert main(["serve", "tiny", "--replicas", "2"]) == 0
    assert fleets[0][0].routing.routing == "prefix"


@pytest.mark.parametrize("flags", [["--routing", "prefix"], ["--ray-address", "auto"]])
def test_fleet_flags_without_replicas_are_refused(monkeypatch, capsys, flags):
    monkeypatch.setattr(ttftc.llm, "LLM", lambda *a, **k: pytest.fail("refused before the model loads"))
    assert main(["serve", "tiny", *flags]) == 2
    assert "--replicas" in capsys.readouterr().err


def test_replicas_without_ray_name_the_install_line(monkeypatch, capsys):
    monkeypatch.setattr(serve_fleet, "_MISSING", ImportError("No module named 'ray'"))
    assert main(["serve", "tiny", "--replicas", "2"]) == 2
    assert "pip install 'ttftc[fleet]'" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_RAY, reason="the fleet runs on Ray Serve: pip install 'ttftc[fleet]'")
def test_the_real_command_serves_two_replicas_and_stops_its_cluster_on_sigterm():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "ttftc.cli", "serve", "tiny", "--replicas", "2", "--port", str(port),
               "--buckets", "none", "--eager-kv-path", "--precision", "fp32", "--tenant-header", "X-Tenant",
               "--threads", "1"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    try:
        lines = []
        for line in process.stderr:  # until the command says it is ready (or dies)
            lines.append(line)
            if "replicas ready" in line:
                break
        assert process.poll() is None, "".join(lines[-40:])
        body = json.dumps({"model": "tiny", "prompt": list(range(1, 40)), "max_tokens": 3}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", "X-Tenant": "t"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.headers["x-ttftc-replica"] in ("replica-0", "replica-1")
            assert json.loads(response.read())["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGTERM)
        rest = process.communicate(timeout=120)[1]
        assert process.returncode == 0, rest[-4000:]
        assert "fleet stopped" in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
