"""Serving that keeps its TTFT promise, end to end through the real `openai` client: tenant priorities, priority
order under a busy engine, the TTFT estimate's header and metrics, and 429s when the estimate misses the SLO.

The engine is made busy deterministically: a gate holds its thread before each step, so requests pile up in its
queue exactly as they would behind a long step, and are released when the test says so.
"""

from __future__ import annotations

import asyncio
import math
import threading

import openai
import pytest

import ttftc
from ttftc.llm import GenerationParams
from ttftc.runtime.prefix_cache import PRIVATE
from ttftc.serve import BackgroundServer, create_app
from ttftc.serve.app import ESTIMATE_HEADER
from ttftc.serve.policy import ServingPolicy
from tests.serve.helpers import metric, submitted_priorities, wait_until

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def served():
    llm = ttftc.LLM("tiny", precision="fp32", buckets=None, chunked_prefill=64, max_batch_tokens=256,
                    batch_window_ms=0.0, compile_kv_path=False)
    policy = ServingPolicy(tenant_priorities={"batch": 5, "vip": -2})
    server = BackgroundServer(create_app(llm, tenant_header="X-Tenant", policy=policy)).start()
    yield llm, server
    server.stop()
    llm.close(drain_timeout_s=5)


@pytest.fixture
def client(served):
    _, server = served
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture
def gate(served, monkeypatch):
    """Closed: the engine thread waits before its next step (a busy engine); `gate.set()` lets it go."""
    llm, _ = served
    event = threading.Event()
    step = llm._loop._step

    def held_step():
        event.wait(TIMEOUT_S)
        step()

    monkeypatch.setattr(llm._loop, "_step", held_step)
    yield event
    event.set()
    wait_until(lambda: llm.stats()["running"] == 0 and llm.stats()["waiting"] == 0, what="the engine to go idle")


def ids(n: int, seed: int = 0) -> list[int]:
    return [(seed * 53 + 5 * i + 1) % 509 for i in range(n)]


def get_metrics(server) -> str:
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=TIMEOUT_S) as response:
        return response.read().decode()


def test_a_tenants_priority_is_the_best_of_its_range_and_a_request_outside_it_gets_a_400(served, client,
                                                                                         monkeypatch):
    llm, _ = served
    submitted = submitted_priorities(monkeypatch, llm)
    # (tenant, requested, what it runs at; None: a 400). A single value is a range's best: 5 means 5 and later.
    cases = [("batch", None, 5), ("batch", -3, None), ("batch", 9, 9), ("vip", None, -2), ("vip", -7, None),
             ("vip", 3, 3), ("acme", -3, None), ("acme", 4, 4), (None, None, 0), (None, -3, None)]
    for tenant, requested, expected in cases:
        body = {"ignore_eos": True} if requested is None else {"ignore_eos": True, "priority": requested}
        headers = {"X-Tenant": tenant} if tenant else {}
        if expected is None:
            with pytest.raises(openai.BadRequestError, match=f"priority {requested} is outside"):
                client.completions.create(model="tiny", prompt=ids(6), max_tokens=2, temperature=0,
                                          extra_body=body, extra_headers=headers)
            continue
        client.completions.create(model="tiny", prompt=ids(6), max_tokens=2, temperature=0, extra_body=body,
                                  extra_headers=headers)
    assert submitted == [expected for _, _, expected in cases if expected is not None]


def test_under_a_busy_engine_requests_get_their_first_token_in_priority_order(served, gate):
    llm, server = served
    requests = []
    submit = llm._loop.submit

    def spy(request, *args, **kwargs):
        requests.append(request)
        return submit(request, *args, **kwargs)

    first_tokens = []
    on_token = llm._scheduler.on_token

    def record(request_id, token):
        if request_id not in first_tokens:
            first_tokens.append(request_id)
        on_token(request_id, token)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)

        async def one(tenant, seed):
            headers = {"X-Tenant": tenant} if tenant else {}
            await aclient.completions.create(model="tiny", prompt=ids(40, seed), max_tokens=2, temperature=0,
                                             extra_body={"ignore_eos": True}, extra_headers=headers)

        async def queued(count):
            while len(requests) < count:
                await asyncio.sleep(0.01)

        try:
            # The blocker is queued first; the rest arrive, least important first, while the engine's step is held.
            tasks = [asyncio.create_task(one(None, 1))]
            await queued(1)
            for k, tenant in enumerate(("batch", None, "vip")):
                tasks.append(asyncio.create_task(one(tenant, 2 + k)))
                await queued(2 + k)
            gate.set()
            await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        finally:
            await aclient.close()

    try:
        llm._loop.submit = spy
        llm._scheduler.on_token = record
        asyncio.run(run())
    finally:
        llm._loop.submit = submit
        llm._scheduler.on_token = on_token
    # The held step had not planned its prefills yet: the arrivals join it (the scheduler's intake), so all four
    # go by priority, and the blocker leads the other priority-0 request, which arrived after it.
    priority = {r.request_id: r.priority for r in requests}
    assert [priority[request_id] for request_id in first_tokens] == [-2, 0, 0, 5]
    assert first_tokens[1] == requests[0].request_id


def test_every_response_carries_its_ttft_estimate_and_metrics_set_it_beside_the_actual(served, client):
    _, server = served
    before = get_metrics(server)
    whole = client.completions.with_raw_response.create(model="tiny", prompt=ids(30, 7), max_tokens=3,
                                                        temperature=0, extra_body={"ignore_eos": True})
    assert whole.parse().usage.completion_tokens == 3
    estimates = [float(whole.headers[ESTIMATE_HEADER])]
    with client.completions.with_streaming_response.create(model="tiny", prompt=ids(30, 8), max_tokens=3,
                                                           temperature=0, stream=True,
                                                           extra_body={"ignore_eos": True}) as streamed:
        estimates.append(float(streamed.headers[ESTIMATE_HEADER]))
        lines = [line for line in streamed.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(0 < e < 60_000 for e in estimates), estimates
    after = get_metrics(server)
    for name in ("ttftc_estimated_time_to_first_token_seconds_count", "ttftc_ttft_estimate_relative_error_count",
                 "ttftc_ttft_estimate_abs_relative_error_count", "ttftc_time_to_first_token_seconds_count"):
        assert metric(after, name) == metric(before, name) + 2, name
    added = (metric(after, "ttftc_estimated_time_to_first_token_seconds_sum")
             - metric(before, "ttftc_estimated_time_to_first_token_seconds_sum"))
    assert added * 1e3 == pytest.approx(sum(estimates), abs=2.0)  # the header is the estimate, rounded to 1 ms
    for term in ("forward_s", "token_s", "attend_s", "step_s", "row_s"):
        assert f'ttftc_cost_model{{term="{term}"}} ' in after, term
    assert metric(after, "ttftc_cost_model", 'term="forward_s"') > 0


def test_overload_gets_429_with_the_estimate_and_retry_after_and_less_important_requests_go_first(served, client,
                                                                                                   gate):
    llm, server = served
    params = GenerationParams(max_new_tokens=1, ignore_eos=True)
    # Work of a better priority than every request below, queued behind the held step: about 16k prompt tokens.
    queued = [llm.open(ids(4000, 40 + k), params, lambda event: None, tenant=PRIVATE, priority=-5)
              for k in range(4)]
    wait_until(lambda: llm._loop.waiting + llm._loop.running >= 4, what="the queue to fill")
    short = ids(8, 99)
    estimate = llm.estimate(short, tenant=PRIVATE, priority=0, max_new_tokens=2)
    assert estimate.ttft_s > 0.05 and estimate.drain_s >= estimate.ttft_s
    served_app = server.app.state.served
    # An SLO at the estimate itself: priority 0 is admitted up to 1.2x it, priority 1 (shed first) only to 0.8x.
    policy = served_app.policy
    served_app.policy = ServingPolicy(slo_ttft_ms=estimate.ttft_s * 1e3, slo_margin=0.2, shed_priority_above=0)
    before = get_metrics(server)
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="tiny", prompt=short, max_tokens=2, temperature=0,
                                      extra_body={"ignore_eos": True, "priority": 1})
        # Answered while the engine is held: refused at once, not after waiting.
        response = refused.value.response
        error = refused.value.body
        assert response.status_code == 429
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "slo_ttft_exceeded"
        assert "estimated time to first token" in error["message"]
        estimated_ms = float(response.headers[ESTIMATE_HEADER])
        assert estimated_ms > 0.8 * estimate.ttft_s * 1e3
        retry = int(response.headers["Retry-After"])
        assert 1 <= retry <= math.ceil(estimate.drain_s) + 1
        # The same load, a request of priority 0: admitted (its headers come at once; its tokens after the gate).
        with client.completions.with_streaming_response.create(
                model="tiny", prompt=short, max_tokens=2, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "priority": 0}) as admitted:
            assert admitted.status_code == 200
            assert float(admitted.headers[ESTIMATE_HEADER]) <= 1.2 * estimate.ttft_s * 1e3
            for output in queued:  # the long prompts are not under test: let the short one through
                llm.cancel(output.request_id)
            gate.set()
            assert [line for line in admitted.iter_lines() if line][-1] == "data: [DONE]"
    finally:
        served_app.policy = policy
        gate.set()
    after = get_metrics(server)
    assert metric(after, "ttftc_requests_shed_total", 'priority_class="shed_first"') == metric(
        before, "ttftc_requests_shed_total", 'priority_class="shed_first"') + 1
    assert metric(after, "ttftc_request_errors_total", 'status="429"') == metric(
        before, "ttftc_request_errors_total", 'status="429"') + 1


def test_without_an_slo_nothing_is_refused(served, client, gate):
    llm, _ = served
    params = GenerationParams(max_new_tokens=1, ignore_eos=True)
    queued = [llm.open(ids(4000, 60 + k), params, lambda event: None, tenant=PRIVATE, priority=-5)
              for k in range(2)]
    with client.completions.with_streaming_response.create(model="tiny", prompt=ids(8), max_tokens=1,
                                                           temperature=0, stream=True,
                                                           extra_body={"priority": 7}) as response:
        assert response.status_code == 200 and float(response.headers[ESTIMATE_HEADER]) > 0
        for output in queued:
            llm.cancel(output.request_id)
        gate.set()
        assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"


def test_tenant_priorities_without_a_tenant_header_are_refused(served):
    llm, _ = served
    with pytest.raises(ValueError, match="tenant priorities need a tenant header"):
        create_app(llm, policy=ServingPolicy(tenant_priorities={"batch": 5}))
    with pytest.raises(ValueError, match="slo_margin"):
        ServingPolicy(slo_ttft_ms=700, slo_margin=1.5)
    with pytest.raises(ValueError, match="tenant 'batch': a priority range's best must be an integer"):
        ServingPolicy(tenant_priorities={"batch": 2**31})


def test_serve_refuses_bad_policy_flags_before_loading_a_model(capsys):
    from ttftc.cli import main

    for flags in (["--tenant-priority", "batch"], ["--tenant-priority", "batch=high"],
                  ["--tenant-priority", "batch=2147483648"], ["--slo-margin", "1"], ["--slo-ttft-ms", "0"]):
        with pytest.raises(SystemExit) as exited:
            main(["serve", "tiny", *flags])
        assert exited.value.code == 2, flags
    assert main(["serve", "tiny", "--tenant-priority", "batch=5"]) == 2
    assert "--tenant-priority and a priority file's tenants need --tenant-header" in capsys.readouterr().err
    assert main(["serve", "tiny", "--tenant-header", "X-Tenant", "--tenant-priority", "a=1",
                 "--tenant-priority", "a=2"]) == 2
    assert "names 'a' more than once" in capsys.readouterr().err
