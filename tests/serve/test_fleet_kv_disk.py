"""A fleet with `--kv-disk`: every replica shares the one directory. A second fleet on it starts warm on every replica
from what the first wrote, and a running replica hits a prefix that another running replica wrote. Skipped without
Ray."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("ray.serve", reason="the fleet runs on Ray Serve: pip install 'ttftc[fleet]'")

import openai  # noqa: E402

from ttftc.fleet.deployment import REPLICA_HEADER, Fleet, FleetSpec  # noqa: E402
from ttftc.fleet.routing import RoutingConfig  # noqa: E402

PROMPT = [(7 * i + 3) % 500 for i in range(48)]  # 3 full blocks of 16
FILLER = [(13 * i + 1) % 500 for i in range(48)]  # 3 other blocks: push PROMPT out of a replica's RAM
# tiny's KV block: 2 layers x (K, V) x 2 KV heads x 16 tokens x 64 dims x 4 bytes (fp32)
TINY_BLOCK_BYTES = 2 * 2 * 2 * 16 * 64 * 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fleet(directory, routing: str, **llm_kwargs) -> Fleet:
    spec = FleetSpec("tiny", 2, app_kwargs={"tenant_header": "X-Tenant"}, drain_timeout_s=2.0,
                     routing=RoutingConfig(routing),
                     llm_kwargs={"precision": "fp32", "buckets": None, "compile_kv_path": False,
                                 "kv_disk": str(directory), "kv_disk_bytes": 64 << 20, **llm_kwargs})
    return Fleet(spec, port=_free_port(), num_cpus=4)


def _ask(client, prompt, tenant) -> tuple[int, str]:
    """(cached tokens, replica) of one request."""
    raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt + [1, 2], max_tokens=1,
                                                      temperature=0, extra_headers={"X-Tenant": tenant})
    return raw.parse().usage.prompt_tokens_details.cached_tokens, raw.headers[REPLICA_HEADER]


def _ask_until(client, prompt, tenant, wanted, tries=6) -> tuple[int, str]:
    """Ask until a replica `wanted(replica)` answers (balanced routing takes turns): its (cached tokens, replica)."""
    for _ in range(tries):
        cached, replica = _ask(client, prompt, tenant)
        if wanted(replica):
            return cached, replica
    raise AssertionError(f"no wanted replica answered in {tries} requests")


def _blocks(directory) -> list:
    return [p for p in directory.iterdir() if p.name.endswith(".safetensors") and not p.name.startswith(".")]


@pytest.mark.slow  # two fleets start and stop: a minute or two on a busy 2-core machine
def test_replicas_share_one_directory_while_they_run_and_across_a_restart(tmp_path):
    # Balanced routing takes turns, so the test chooses which replica serves; a RAM cache of 3 blocks makes a
    # replica spill a prefix to the directory as soon as it serves another.
    with _fleet(tmp_path, "balanced", prefix_cache_bytes=3 * TINY_BLOCK_BYTES) as fleet:
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="test", max_retries=0, timeout=60)
        cached, writer = _ask(client, PROMPT, "acme")
        assert cached == 0
        _ask_until(client, FILLER, "acme", lambda replica: replica == writer)  # PROMPT's blocks go to disk
        # The other replica, running since before those blocks existed, finds them in the shared directory.
        cached, reader = _ask_until(client, PROMPT, "acme", lambda replica: replica != writer)
        assert cached == 48, (writer, reader)
        assert _ask(client, PROMPT, "globex")[0] == 0  # another tenant never sees acme's blocks
    assert len(_blocks(tmp_path)) >= 3  # and every replica wrote what it held when the fleet stopped
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # one directory, no per-replica ones

    # A second fleet on the directory: each of its replicas starts warm from the blocks the first fleet wrote.
    with _fleet(tmp_path, "balanced") as fleet:
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="test", max_retries=0, timeout=60)
        first = _ask(client, PROMPT, "acme")
        second = _ask_until(client, PROMPT, "acme", lambda replica: replica != first[1])
        assert first[0] == second[0] == 48, (first, second)
        assert _ask(client, PROMPT, "initech")[0] == 0  # a tenant that never sent it
