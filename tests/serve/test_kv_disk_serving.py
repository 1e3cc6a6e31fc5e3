"""The prefix cache's disk tier through a real server and the real `openai` client: a restart hits what the last run
cached, tenants stay isolated there, a corrupted block is refused (and recomputed), /metrics shows the tier."""

from __future__ import annotations

import urllib.request

import openai
import pytest

import ttftc
from tests.serve.helpers import metric
from ttftc.serve import BackgroundServer, create_app

TIMEOUT_S = 60
PROMPT = [(7 * i + 3) % 500 for i in range(48)]  # 3 full blocks of 16


def _llm(directory):
    return ttftc.LLM("tiny", precision="fp32", buckets=None, compile_kv_path=False, kv_disk=directory,
                     kv_disk_bytes=64 << 20)


def _cached_tokens(server, tenant: str) -> int:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)
    response = client.completions.create(model="tiny", prompt=PROMPT + [1, 2], max_tokens=1, temperature=0,
                                         extra_headers={"X-Tenant": tenant})
    return response.usage.prompt_tokens_details.cached_tokens


def _metrics(server) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=TIMEOUT_S) as response:
        return response.read().decode()


def _serve_once(directory, requests, corrupt=None):
    """Start a server on a fresh LLM over `directory`, send `requests` (tenants), close it; cached tokens and the
    metrics text."""
    if corrupt is not None:
        corrupt()
    llm = _llm(directory)
    try:
        with BackgroundServer(create_app(llm, tenant_header="X-Tenant")) as server:
            cached = [_cached_tokens(server, tenant) for tenant in requests]
            text = _metrics(server)
    finally:
        llm.close(drain_timeout_s=5)
    return cached, text


def test_a_restart_hits_the_prefix_the_last_run_cached_and_only_for_its_tenant(tmp_path):
    cached, _ = _serve_once(tmp_path, ["acme"])
    assert cached == [0]
    assert len(list(tmp_path.glob("*.safetensors"))) == 3  # the first server's blocks, written at close
    cached, text = _serve_once(tmp_path, ["acme", "globex"])
    assert cached == [48, 0], "acme's prefix came back from disk; globex never sees it"
    assert metric(text, "ttftc_prefix_cache_disk", 'quantity="loaded"') == 3
    assert metric(text, "ttftc_prefix_cache_disk", 'quantity="blocks"') >= 3


def test_a_corrupted_block_is_refused_and_its_tokens_recomputed(tmp_path):
    _serve_once(tmp_path, ["acme"])
    blocks = sorted(tmp_path.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)

    def corrupt():
        for path in blocks:  # every block: whichever comes second in the chain is damaged too
            data = path.read_bytes()
            path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))

    with pytest.warns(UserWarning, match="KV disk tier: refused"):
        cached, text = _serve_once(tmp_path, ["acme"], corrupt=corrupt)
    assert cached == [0]
    assert metric(text, "ttftc_prefix_cache_disk", 'quantity="refused"') == 1  # the chain stops at the first


def test_kv_disk_needs_the_prompt_cache(tmp_path):
    with pytest.raises(ValueError, match="kv_disk needs prompt_cache=True"):
        ttftc.LLM("tiny", precision="fp32", buckets=None, compile_kv_path=False, prompt_cache=False,
                  kv_disk=tmp_path, warmup=False)
