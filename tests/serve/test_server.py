"""`ttftc serve` end to end: a real server on a free 127.0.0.1 port, driven by the real `openai` client."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest

import ttftc
from ttftc.serve import BackgroundServer, create_app
from tests.serve.helpers import metric, submitted_priorities, wait_until

TIMEOUT_S = 60  # per request: a stuck server fails the test instead of hanging it


@pytest.fixture(scope="module")
def served():
    # The KV path stays eager: tests/conftest.py resets Dynamo around every test, which would recompile it each
    # time (tests/test_llm.py covers the compiled KV path).
    llm = ttftc.LLM("tiny", precision="fp32", buckets=(64,), prefill_batch_sizes=(1, 2, 4), chunked_prefill=32,
                    max_batch_tokens=256, batch_window_ms=2.0, compile_kv_path=False)
    assert llm._engine.prefill_model is not None, llm.notes  # the bucketed path is under test too
    server = BackgroundServer(create_app(llm, tenant_header="X-Tenant")).start()
    yield llm, server
    server.stop()
    llm.close(drain_timeout_s=5)


@pytest.fixture
def client(served):
    _, server = served
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 131 + 7 * i + 3) % 512 for i in range(n)]


def streamed(client, ids, max_tokens, **kwargs):
    """(token ids in stream order, the chunks)."""
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, temperature=0,
                                            stream=True, **kwargs))
    tokens = [t for c in chunks for choice in c.choices for t in choice.model_extra.get("token_ids", [])]
    return tokens, chunks


def get(url):  # a URL or a urllib Request
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_streamed_tokens_equal_llm_generate_greedy_tokens(served, client):
    llm, _ = served
    for n in (20, 100):  # in a bucket; and longer than the bucket, so chunked past its bucketed first chunk
        ids = prompt(n, seed=n)
        tokens, chunks = streamed(client, ids, 12, extra_body={"ignore_eos": True})
        (expected,) = llm.generate([ids], max_new_tokens=12, ignore_eos=True)
        assert tokens == expected.token_ids and len(tokens) == 12
        assert chunks[0].choices[0].model_extra["token_ids"], "the first chunk carries the first token"
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].text for c in chunks) == expected.text == "".join(f"<{t}>" for t in tokens)
        whole = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert whole.choices[0].model_extra["token_ids"] == tokens and whole.usage.completion_tokens == 12


def test_32_concurrent_streams_all_complete(served):
    llm, server = served
    prompts = [prompt(8 + 3 * k, seed=k) for k in range(32)]

    async def one(client, ids):
        stream = await client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        tokens, finish = [], None
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += choice.model_extra.get("token_ids", [])
                finish = choice.finish_reason or finish
        return tokens, finish

    async def run_all():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), TIMEOUT_S)
        finally:
            await client.close()

    results = asyncio.run(run_all())
    assert all(finish == "length" and len(tokens) == 8 for tokens, finish in results)
    expected = llm.generate(prompts, max_new_tokens=8, ignore_eos=True, timeout_s=TIMEOUT_S)
    assert [tokens for tokens, _ in results] == [e.token_ids for e in expected]
    wait_until(lambda: llm.stats()["running"] == 0, what="the streams to leave the engine")


def test_metrics_move(served, client):
    _, server = served
    _, before = get(server.url + "/metrics")
    streamed(client, prompt(40, seed=99), 5, extra_body={"ignore_eos": True})
    _, after = get(server.url + "/metrics")
    for name in ("ttftc_time_to_first_token_seconds_count", "ttftc_queue_time_seconds_count",
                 "ttftc_prefill_tokens_computed_count", "ttftc_prefill_tokens_cached_count"):
        assert metric(after, name) == metric(before, name) + 1, name
    assert metric(after, "ttftc_inter_token_latency_seconds_count") == metric(
        before, "ttftc_inter_token_latency_seconds_count") + 4
    computed = "ttftc_prefill_tokens_computed_sum"
    assert metric(after, computed) == metric(before, computed) + 40
    assert metric(after, "ttftc_requests_total", 'finish_reason="length"') > metric(
        before, "ttftc_requests_total", 'finish_reason="length"')
    for gauge in ("ttftc_requests_running", "ttftc_requests_waiting", "ttftc_prefix_cache_bytes", "ttftc_kv_tokens"):
        assert f"\n{gauge} " in after, gauge


BAD_REQUESTS = [
    ("unknown model", dict(model="gpt-5", prompt=[1, 2]), "model"),
    ("empty prompt", dict(prompt=[]), "prompt"),
    ("empty text prompt", dict(prompt=""), "prompt"),
    ("text without a tokenizer", dict(prompt="hello"), "prompt"),
    ("token outside the vocabulary", dict(prompt=[1, 512]), "prompt"),
    ("prompt too long", dict(prompt=[1] * 4097), "prompt"),
    ("prompt plus max_tokens too long", dict(prompt=[1] * 4000, max_tokens=200), "max_tokens"),
    ("max_tokens zero", dict(prompt=[1, 2], max_tokens=0), "max_tokens"),
    ("temperature negative", dict(prompt=[1, 2], temperature=-1), "temperature"),
    ("top_p zero", dict(prompt=[1, 2], top_p=0), "top_p"),
    ("n above 1", dict(prompt=[1, 2], n=2), "n"),
    ("echo", dict(prompt=[1, 2], echo=True), "echo"),
    ("logprobs", dict(prompt=[1, 2], logprobs=3), "logprobs"),
    ("a batch of prompts", dict(prompt=[[1, 2], [3, 4]]), "prompt"),
    ("stream_options without stream", dict(prompt=[1, 2], stream_options={"include_usage": True}), "stream_options"),
    ("unknown field", dict(prompt=[1, 2], extra_body={"tenant": "acme"}), "tenant"),
    ("priority not an integer", dict(prompt=[1, 2], extra_body={"priority": "high"}), "priority"),
    ("priority out of range", dict(prompt=[1, 2], extra_body={"priority": -2**31 - 1}), "priority"),
]


@pytest.mark.parametrize("case, kwargs, param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_each_bad_request_gets_its_400_and_the_server_keeps_serving(served, client, case, kwargs, param):
    kwargs = {"model": "tiny", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**kwargs)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"]
    assert streamed(client, [1, 2, 3], 2)[0], "the server still serves"


def test_a_request_with_a_priority_is_served_like_one_without(served, client, monkeypatch):
    llm, _ = served
    submitted = submitted_priorities(monkeypatch, llm)
    ids = prompt(12, seed=5)
    tokens = [streamed(client, ids, 4, extra_body={"ignore_eos": True, "priority": p})[0]
              for p in (3, 2**31 - 1, None)]
    assert submitted == [3, 2**31 - 1, 0]  # null is the default (below 0 needs a tenant's range: test_admission)
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 4


def test_malformed_bodies_and_chat_without_a_tokenizer_get_400(served, client):
    _, server = served
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        request = urllib.request.Request(server.url + "/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        status, text = get(request)  # type: ignore[arg-type]
        assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    status, text = get(server.url + "/v1/nothing-here")
    assert status == 404 and json.loads(text)["error"]["type"] == "not_found_error"


def test_a_client_that_disconnects_frees_its_slot_and_kv(served, client):
    llm, server = served
    _, before = get(server.url + "/metrics")
    stream = client.completions.create(model="tiny", prompt=prompt(30), max_tokens=4000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    assert llm.stats()["running"] == 1 and llm.stats()["kv_tokens"] > 30
    stream.close()  # the client goes away mid-stream
    wait_until(lambda: llm.stats()["running"] == 0 and llm.stats()["kv_tokens"] == 0, what="the slot to be freed")
    _, after = get(server.url + "/metrics")
    assert metric(after, "ttftc_requests_total", 'finish_reason="disconnected"') == metric(
        before, "ttftc_requests_total", 'finish_reason="disconnected"') + 1
    assert streamed(client, [4, 5, 6], 2)[0], "the server still serves"


def test_requests_without_a_tenant_share_nothing(served, client):
    ids = prompt(48, seed=7)

    def cached(**kwargs) -> int:
        response = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, **kwargs)
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0 and cached() == 0, "no tenant: the second identical request reused nothing"
    assert cached(user="acme") == 0, "a field of the body never names a tenant"
    assert cached(extra_headers={"X-Tenant": "acme"}) == 0
    assert cached(extra_headers={"X-Tenant": "acme"}) == 32, "the same tenant reuses its cached blocks"
    assert cached(extra_headers={"X-Tenant": "other"}) == 0, "another tenant sees none of them"
    assert cached() == 0


def test_the_llms_in_process_namespace_is_not_served_to_requests_without_a_tenant(served, client):
    llm, _ = served
    ids = [(37 * i + 11) % 509 for i in range(48)]  # a prompt no other test of this module sends
    assert [llm.generate(ids, max_new_tokens=1)[0].cached_tokens for _ in range(2)] == [0, 32], "in-process: shared"
    response = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0)
    assert response.usage.prompt_tokens_details.cached_tokens == 0, "no header: never the LLM's own namespace"


def test_health_and_models(served, client):
    _, server = served
    status, body = get(server.url + "/health")
    assert status == 200 and json.loads(body) == {"status": "ok", "buckets_compiling": 0, "warm": True}
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.model_extra["max_model_len"] == 4096 and card.model_extra["vocab_size"] == 512


def test_a_disconnect_during_batched_decodes_frees_its_slot_and_the_other_streams_keep_their_tokens(served, client):
    llm, _ = served
    ids = [prompt(20 + 5 * i, seed=20 + i) for i in range(3)]
    expected = [c.token_ids for c in llm.generate(ids, max_new_tokens=40, ignore_eos=True)]
    calls = []
    real = llm._engine.decode_batch
    llm._engine.decode_batch = lambda rows: calls.append(len(rows)) or real(rows)
    try:
        async def run():
            aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="test", max_retries=0, timeout=TIMEOUT_S)

            async def full(i):
                stream = await aclient.completions.create(model="tiny", prompt=ids[i], max_tokens=40, temperature=0,
                                                          stream=True, extra_body={"ignore_eos": True})
                return [t async for c in stream for ch in c.choices for t in ch.model_extra.get("token_ids", [])]

            async def leaver():
                stream = await aclient.completions.create(model="tiny", prompt=prompt(33, seed=9), max_tokens=4000,
                                                          temperature=0, stream=True, extra_body={"ignore_eos": True})
                received = 0
                async for _ in stream:
                    received += 1
                    if received == 5:
                        break
                await stream.close()  # goes away while it decodes in a batch with the others

            results = await asyncio.gather(full(0), leaver(), full(1), full(2))
            await aclient.close()
            return results

        got = asyncio.run(run())
    finally:
        llm._engine.decode_batch = real
    assert [got[0], got[2], got[3]] == expected
    assert max(calls) >= 3, "the streams decoded together"
    wait_until(lambda: llm.stats()["running"] == 0 and llm.stats()["kv_tokens"] == 0, what="every slot to be freed")
