"""A fleet with `--kv-disk`: each replica keeps its own subdirectory, writes its blocks there when the fleet stops,
and the same replica of the next fleet on that directory starts warm from them. Skipped without Ray."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("ray.serve", reason="the fleet runs on Ray Serve: pip install 'ttftc[fleet]'")

import openai  # noqa: E402

from ttftc.fleet.deployment import REPLICA_HEADER, Fleet, FleetSpec  # noqa: E402

PROMPT = [(7 * i + 3) % 500 for i in range(48)]  # 3 full blocks of 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_once(directory, tenants):
    """A fresh 2-replica fleet over `directory`: [(cached tokens, replica)] per tenant's request, then stop it."""
    spec = FleetSpec("tiny", 2, app_kwargs={"tenant_header": "X-Tenant"}, drain_timeout_s=2.0,
                     llm_kwargs={"precision": "fp32", "buckets": None, "compile_kv_path": False,
                                 "kv_disk": str(directory), "kv_disk_bytes": 64 << 20})
    with Fleet(spec, port=_free_port(), num_cpus=4) as fleet:
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="test", max_retries=0, timeout=60)
        out = []
        for tenant in tenants:
            raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT + [1, 2], max_tokens=1,
                                                              temperature=0, extra_headers={"X-Tenant": tenant})
            out.append((raw.parse().usage.prompt_tokens_details.cached_tokens, raw.headers[REPLICA_HEADER]))
    return out


@pytest.mark.slow  # two fleets start and stop: about a minute on a busy 2-core machine
def test_a_restarted_fleet_starts_warm_from_each_replicas_own_blocks(tmp_path):
    ((cached, replica),) = _serve_once(tmp_path, ["acme"])
    assert cached == 0
    assert len(list((tmp_path / replica).glob("*.safetensors"))) == 3  # written when the fleet stopped
    assert not list(tmp_path.glob("*.safetensors"))  # nothing outside the replicas' own directories
    (again, same), (other, _) = _serve_once(tmp_path, ["acme", "globex"])
    assert (again, same) == (48, replica), "acme's key routes to the same replica, which loads its blocks"
    assert other == 0  # another tenant never sees them
