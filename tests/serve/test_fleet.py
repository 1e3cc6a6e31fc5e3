"""`ttftc serve --replicas 2` for real: a local Ray cluster serving `tiny` in 2 replicas, driven by the real `openai`
client. Skipped without Ray (pip install 'ttftc[fleet]'). tests/serve/test_fleet_routing.py covers the routing
logic itself without Ray."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import urllib.request

import pytest

pytest.importorskip("ray.serve", reason="the fleet runs on Ray Serve: pip install 'ttftc[fleet]'")

import openai  # noqa: E402

from ttftc.fleet.deployment import APP_NAME, REPLICA_HEADER, Fleet, FleetSpec  # noqa: E402
from ttftc.serve.policy import ServingPolicy  # noqa: E402
from tests.serve.helpers import metric, wait_until  # noqa: E402

TIMEOUT_S = 60
REPLICAS = {"replica-0", "replica-1"}
BLOCK = 16  # the prefix cache's block size: what a hit is counted in


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet():
    policy = ServingPolicy(tenant_priorities={"batch": 5})
    spec = FleetSpec("tiny", 2, app_kwargs={"tenant_header": "X-Tenant", "policy": policy}, drain_timeout_s=2.0,
                     llm_kwargs={"precision": "fp32", "buckets": None, "compile_kv_path": False,
                                 "chunked_prefill": 32})
    with Fleet(spec, port=_free_port(), num_cpus=4) as running:
        yield running


@pytest.fixture
def client(fleet):
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)


def complete(client, ids, tenant, **kwargs):
    """(the parsed completion, the replica that served it)."""
    raw = client.completions.with_raw_response.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                                      extra_headers={"X-Tenant": tenant}, **kwargs)
    return raw.parse(), raw.headers.get(REPLICA_HEADER)


def cached(completion) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens


def system_prompt(seed: int, n: int = 3 * BLOCK) -> list[int]:
    return [(seed * 97 + 5 * i + 11) % 500 + 7 for i in range(n)]


def test_streamed_and_whole_responses_agree_and_name_their_replica(client):
    ids = system_prompt(100)
    whole, replica = complete(client, ids, "streams", extra_body={"ignore_eos": True})
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=ids, max_tokens=4, temperature=0, stream=True, extra_headers={"X-Tenant": "streams"},
        extra_body={"ignore_eos": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    chunks = list(raw.parse())
    tokens = [t for c in chunks for choice in c.choices for t in choice.model_extra.get("token_ids", [])]
    assert tokens == whole.choices[0].model_extra["token_ids"] and len(tokens) == 4
    assert chunks[-1].choices[0].finish_reason == "length"
    assert replica in REPLICAS and raw.headers[REPLICA_HEADER] == replica  # same tenant and prompt: same replica


def test_turns_after_the_first_stay_on_one_replica_and_hit_its_cache(client, fleet):
    served = set()
    for seed in range(6):
        system = system_prompt(seed)
        replicas = []
        for turn in range(3):
            completion, replica = complete(client, system + [400 + turn] * 8, "acme")
            replicas.append(replica)
            if turn == 0:
                assert cached(completion) == 0
            else:  # the whole system prompt (3 blocks) came from the replica's cache
                assert cached(completion) >= len(system), (seed, turn, replica)
        assert len(set(replicas)) == 1, replicas
        served |= set(replicas)
    assert served == REPLICAS  # six system prompts: both replicas serve some
    with urllib.request.urlopen(fleet.url + "/metrics", timeout=TIMEOUT_S) as response:
        text = response.read().decode()
    for name in REPLICAS:  # per-replica series, labelled
        assert f'ttftc_fleet_routed_total{{replica="{name}",reason="affinity"}}' in text
        assert f'replica="{name}"' in text.split("ttftc_fleet_routed_total")[0]


def test_a_prefix_cached_for_one_tenant_is_no_hit_for_another_on_any_replica(client):
    system = system_prompt(200)
    complete(client, system + [1] * 4, "owner")
    again, owner_replica = complete(client, system + [2] * 4, "owner")
    assert cached(again) >= len(system)
    seen = set()
    for k in range(8):  # other tenants hash elsewhere on the ring: some land on the owner's replica, some not
        other, replica = complete(client, system + [2] * 4, f"other-{k}")
        assert cached(other) == 0, (k, replica)
        seen.add(replica)
    assert owner_replica in seen and seen == REPLICAS


def test_errors_health_and_models_come_back_as_the_single_server_answers_them(client, fleet):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="no-such-model", prompt=[1, 2, 3], max_tokens=2)
    assert error.value.code == "model_not_found" and error.value.response.headers[REPLICA_HEADER] in REPLICAS
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=-1)
    assert error.value.response.status_code == 400
    assert [m.id for m in client.models.list()] == ["tiny"]
    with urllib.request.urlopen(fleet.url + "/health", timeout=TIMEOUT_S) as response:
        assert response.status == 200 and response.headers[REPLICA_HEADER] in REPLICAS
    # A body declared larger than the single server takes is refused before it is read (so none is sent here).
    host, port = fleet.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    try:
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str((8 << 20) + 1))
        connection.endheaders()
        refused = connection.getresponse()
        assert refused.status == 413 and b"larger than" in refused.read()
    finally:
        connection.close()


def test_the_tenant_policy_and_the_ttft_estimate_hold_in_every_replica(client):
    for k in range(4):  # distinct prompts: both replicas answer some
        with pytest.raises(openai.BadRequestError) as error:
            complete(client, system_prompt(500 + k), "batch", extra_body={"priority": 0})
        assert error.value.code == "priority_not_allowed"
    raw = client.completions.with_raw_response.create(model="tiny", prompt=system_prompt(600), max_tokens=2,
                                                      extra_headers={"X-Tenant": "batch"})
    assert float(raw.headers["x-ttftc-estimated-ttft-ms"]) >= 0


def test_a_client_that_leaves_mid_stream_frees_its_replica(client, fleet):
    def metrics() -> str:
        with urllib.request.urlopen(fleet.url + "/metrics", timeout=TIMEOUT_S) as response:
            return response.read().decode()

    with client.completions.with_streaming_response.create(
            model="tiny", prompt=system_prompt(700), max_tokens=4000, temperature=0, stream=True,
            extra_headers={"X-Tenant": "leaver"}, extra_body={"ignore_eos": True}) as response:
        replica = response.headers[REPLICA_HEADER]
        next(response.iter_lines())
    # The replica's app saw its client leave (the ingress cancelled the Ray stream) and cancelled the engine
    # request; the ingress no longer counts it against the replica.
    wait_until(lambda: metric(metrics(), "ttftc_requests_total",
                              f'replica="{replica}",finish_reason="disconnected"') >= 1,
               timeout_s=30, what="the replica to count the request as disconnected")
    text = metrics()
    assert sum(metric(text, "ttftc_fleet_in_flight", f'replica="{name}"') for name in REPLICAS) == 0


def test_killing_a_replica_mid_stream_ends_that_stream_cleanly_and_the_fleet_keeps_serving(client):
    from ray import serve

    ids = system_prompt(300)
    _, replica = complete(client, ids, "victim")
    pid = serve.get_deployment_handle(replica, app_name=APP_NAME).pid.remote().result(timeout_s=TIMEOUT_S)
    stream = client.completions.create(model="tiny", prompt=ids, max_tokens=2000, temperature=0, stream=True,
                                       extra_headers={"X-Tenant": "victim"}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="failed mid-response"):
        for _ in chunks:  # the relay ends it with an error event, not a broken connection
            pass
    # The same tenant and prefix again: its replica is out of the ring, so another serves it.
    completion, other = complete(client, ids, "victim")
    assert other != replica and completion.choices[0].finish_reason in ("length", "stop")
    # Ray Serve restarts the dead replica; a probe puts it back in the ring.
    wait_until(lambda: complete(client, ids, "victim")[1] == replica, timeout_s=120, what="the replica's return")
