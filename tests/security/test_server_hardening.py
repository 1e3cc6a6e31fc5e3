"""Issue 33, the server half: what one client can do to the others through `ttftc serve`.

Stop strings that stall the event loop, clients that leave without their requests leaving the engine, a bad
seed that fails the requests batched with it, a body nested deep enough to crash the parser, and
`cached_tokens` as a prefix oracle. A real uvicorn server on 127.0.0.1, driven by the `openai` client or by raw
sockets where the point is a client that hangs up.
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import re
import socket
import threading
import time
from types import SimpleNamespace

import openai
import pytest

import ttftc
from tests.runtime.test_scheduler_logic import FakeEngine
from tests.runtime.test_scheduler_logic import prompt as fake_prompt
from tests.runtime.test_scheduler_logic import scheduler as fake_scheduler
from tests.serve.helpers import metric, wait_until
from ttftc.llm import GenerationParams, ParamError
from ttftc.runtime.scheduler import ERROR, LENGTH, Request
from ttftc.serve import BackgroundServer, create_app
from ttftc.text import StopStrings

TIMEOUT_S = 30


@pytest.fixture(scope="module")
def llm():
    # A bucket, so that prompts arriving together share a padded prefill; an eager KV path (see tests/serve).
    llm = ttftc.LLM("tiny", precision="fp32", buckets=(64,), chunked_prefill=32, max_batch_tokens=256,
                    compile_kv_path=False)
    assert llm._engine.prefill_model is not None, llm.notes
    yield llm
    llm.close(drain_timeout_s=5)


@pytest.fixture(scope="module")
def server(llm):
    server = BackgroundServer(create_app(llm, tenant_header="X-Tenant")).start()
    yield server
    server.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 131 + 7 * i + 3) % 512 for i in range(n)]


def bad_request(call) -> dict:
    """The OpenAI error object of a call that must get a 400."""
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    assert caught.value.status_code == 400
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


# ---- 3: stop strings ---------------------------------------------------------------------------------------------


def naive_stop_strings(stops, pieces):
    """The stop-string semantics before the linear matcher (quadratic in a stop's length): the reference."""
    held, out, stopped = "", [], False
    for piece in pieces:
        if stopped:
            out.append("")
            continue
        text = held + piece
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            stopped, held = True, ""
            out.append(text[:cut])
            continue
        keep = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        held = text[len(text) - keep:] if keep else ""
        out.append(text[:len(text) - keep])
    return out, stopped, "" if stopped else held


def test_stop_strings_cut_and_hold_back_as_before_on_random_text():
    rng = random.Random(33)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        pieces = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 8))]
        matcher = StopStrings(stops)
        got = [matcher.feed(p) for p in pieces]
        assert (got, matcher.stopped, matcher.flush()) == naive_stop_strings(stops, pieces), (stops, pieces)


def test_a_megabyte_stop_string_costs_each_token_its_own_length():
    stop = "ab" * 500_000
    started = time.perf_counter()
    matcher = StopStrings([stop])  # the KMP table: one pass over the stop
    pieces = ["<7>", "ab" * 100, "a"] + ["ba"] * 2000
    released = "".join(matcher.feed(p) for p in pieces)
    elapsed = time.perf_counter() - started
    assert elapsed < 2.0, f"{elapsed:.2f} s (the quadratic matcher took 31.5 s for 2 tokens)"
    assert not matcher.stopped and released == "<7>"  # everything since is a possible start of the stop: held
    assert matcher.flush() == "ab" * 100 + "a" + "ba" * 2000


def test_a_megabyte_stop_string_gets_a_400_at_once(client):
    started = time.perf_counter()
    error = bad_request(lambda: client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2,
                                                          stop="x" * 1_000_000))
    elapsed = time.perf_counter() - started
    assert error["param"] == "stop" and "1000000 characters" in error["message"] and "256" in error["message"]
    assert elapsed < 1.0, f"{elapsed:.3f} s"  # was 31.5 s of a blocked event loop
    print(f"1 MB stop string: 400 in {elapsed * 1000:.1f} ms")


@pytest.mark.parametrize("stop, message", [
    (["a"] * 5, "5 strings; at most 4"),
    (["a", "b" * 257], r"stop\[1\] is 257 characters long"),
    (["a", ""], "non-empty"),
    ([["a"]], "non-empty string"),
], ids=["five", "one too long", "empty", "not a string"])
def test_stop_strings_beyond_openais_limits_get_a_400(client, stop, message):
    error = bad_request(lambda: client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, stop=stop))
    assert error["param"] == "stop"
    assert re.search(message, error["message"]), error["message"]


def test_four_stop_strings_of_256_characters_are_served(client):
    stops = [c * 256 for c in "wxyz"]
    response = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3, stop=stops,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length" and len(response.choices[0].model_extra["token_ids"]) == 3


# ---- 4: clients that leave ---------------------------------------------------------------------------------------


def send_completion(server, body: dict) -> socket.socket:
    """A POST on a socket of its own, the response never read."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port), timeout=TIMEOUT_S)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def metrics_text(server) -> str:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT_S)
    try:
        connection.request("GET", "/metrics")
        return connection.getresponse().read().decode()
    finally:
        connection.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_clients_that_hang_up_leave_nothing_running_within_2_s(llm, server, stream):
    disconnected = 'finish_reason="disconnected"'
    before = metric(metrics_text(server), "ttftc_requests_total", disconnected)
    # Tokens flow the whole time (a few ms apart): a check that waits for a lull in them would never run.
    sockets = [send_completion(server, {"model": "tiny", "prompt": prompt(20, seed=k), "max_tokens": 4000,
                                        "temperature": 0, "ignore_eos": True, "stream": stream})
               for k in range(10)]
    try:
        wait_until(lambda: llm.stats()["running"] == 10, timeout_s=TIMEOUT_S, what="the ten requests to run")
    finally:
        for sock in sockets:
            sock.close()
    closed = time.perf_counter()
    wait_until(lambda: llm.stats()["running"] == 0, timeout_s=2.0, what="the engine to drop the ten requests")
    print(f"stream={stream}: running == 0 {(time.perf_counter() - closed) * 1000:.0f} ms after the disconnects")
    wait_until(lambda: llm.stats()["kv_tokens"] == 0, timeout_s=2.0, what="their KV to be freed")
    after = metric(metrics_text(server), "ttftc_requests_total", disconnected)
    assert after == before + 10


# ---- 5: seeds and the other sampling fields ----------------------------------------------------------------------


def test_a_bad_seed_fails_only_its_own_row_of_a_shared_prefill(llm, monkeypatch):
    # LLM-level, past the HTTP validation: the scheduler must isolate whatever one row of a batch raises.
    shared = []
    real = llm._engine.prefill_together
    engine = llm._engine
    monkeypatch.setattr(engine, "prefill_together", lambda work, **kw: shared.append(len(work)) or real(work, **kw))
    monkeypatch.setattr(llm._scheduler, "batch_window_s", 0.5)  # the five arrive in one window
    lengths, bad = (10, 12, 14, 16, 18), 2  # the bad row is in the middle of the batch
    events: queue.Queue = queue.Queue()
    with pytest.raises(ParamError, match="seed must be null or an integer from"):
        GenerationParams(seed=2**64)  # refused up front in-process too; the row below gets past that on purpose
    params = [GenerationParams(max_new_tokens=4, seed=i, ignore_eos=True) for i in range(len(lengths))]
    object.__setattr__(params[bad], "seed", 2**64)  # a row that fails inside the shared prefill
    outputs = [llm.open(prompt(n, seed=n), params[i], events.put) for i, n in enumerate(lengths)]
    by_id = {o.request_id: o for o in outputs}
    deadline = time.monotonic() + TIMEOUT_S
    while not all(o.done for o in outputs):
        event = events.get(timeout=max(0.0, deadline - time.monotonic()))
        by_id[event.request_id].on_event(event)
    assert shared[0] == 5, f"the five prefills shared a forward: {shared}"
    results = [o.completion() for o in outputs]
    assert results[bad].finish_reason == "error" and "Overflow" in results[bad].error
    innocent = [r for i, r in enumerate(results) if i != bad]
    assert [r.finish_reason for r in innocent] == ["length"] * 4, [(r.finish_reason, r.error) for r in innocent]
    alone = llm.generate([prompt(n, seed=n) for i, n in enumerate(lengths) if i != bad], max_new_tokens=4,
                         ignore_eos=True)
    assert [r.token_ids for r in innocent] == [a.token_ids for a in alone]
    wait_until(lambda: llm.stats()["running"] == 0 and llm.stats()["kv_tokens"] == 0, what="every slot to be freed")


class FirstTokenFailingEngine(FakeEngine):
    """A shared prefill that serves its rows from the last one back, and whose row `bad` takes its KV, then raises
    as its first token is picked (as a bad seed does)."""

    def __init__(self, bad: int):
        super().__init__(buckets=(8,))
        self.bad = bad

    def prefill_together(self, work, *, publish=True):
        if len(work) == 1:
            return super().prefill_together(work, publish=publish)
        self.calls.append(("together", tuple((job.token_ids[0], n) for job, n in work)))
        for job, n in reversed(work):
            if job.token_ids[0] == self.bad:
                job.position += n
                raise RuntimeError("injected first-token failure")
            job._take(n)
        return [job.result for job, _ in work]


def test_a_row_that_fails_a_shared_prefill_fails_alone_whatever_the_other_rows_reached():
    engine = FirstTokenFailingEngine(bad=3)
    s = fake_scheduler(engine, budget=64, chunk_size=8)
    for first, length in ((1, 3), (3, 5), (4, 6), (2, 20)):  # (2, 20) is chunked: its first 8 tokens share the batch
        s.submit(Request(fake_prompt(first, length), max_new_tokens=1, request_id=first))
    stats = s.step()
    assert engine.calls[0] == ("together", ((1, 3), (3, 5), (4, 6), (2, 8)))
    assert engine.calls[1] == ("together", ((1, 3),)), "the row the batch never reached runs alone"
    assert s.records[3].finish_reason == ERROR and s.records[3].error == "RuntimeError: injected first-token failure"
    assert engine.cancelled == [3] and set(stats.finished) == {1, 3, 4}
    assert s.records[1].tokens == [8] and s.records[4].tokens == [8]  # each prompt's last id + 1
    assert s.records[2].tokens == [] and s.run_until_idle()[2].finish_reason == LENGTH


OUT_OF_RANGE = [
    ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.5), ("seed", "7"), ("seed", True),
    ("temperature", 2.5), ("temperature", -0.1), ("temperature", "1"), ("temperature", [1]),
    ("top_p", 0), ("top_p", 1.01), ("top_k", -2), ("top_k", 2.5),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", 10**30),
    ("n", 0), ("n", 2), ("presence_penalty", 0.5), ("frequency_penalty", -2), ("presence_penalty", "0"),
]


@pytest.mark.parametrize("field, value", OUT_OF_RANGE, ids=[f"{f}={v!r}"[:40] for f, v in OUT_OF_RANGE])
def test_each_sampling_field_out_of_its_range_gets_a_400_naming_it(client, field, value):
    error = bad_request(lambda: client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2,
                                                          extra_body={field: value}))
    assert error["param"] == field and error["message"], error


def test_a_seed_at_either_end_of_its_range_is_served_and_repeats(client):
    for seed in (2**64 - 1, -(2**63)):
        a, b = (client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=1.0, seed=seed,
                                          extra_body={"ignore_eos": True}).choices[0].model_extra["token_ids"]
                for _ in range(2))
        assert a == b and len(a) == 4


# ---- 7: deeply nested bodies -------------------------------------------------------------------------------------


def post_raw(server, bodies: list[bytes]) -> list[tuple[int, dict]]:
    """Each body POSTed in turn on ONE keep-alive connection: (status, error object)."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT_S)
    try:
        results = []
        for body in bodies:
            connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            payload = json.loads(response.read())
            results.append((response.status, payload.get("error", payload)))
        return results
    finally:
        connection.close()


def test_a_deeply_nested_body_gets_a_400_and_the_connection_keeps_serving(server):
    valid = json.dumps({"model": "tiny", "prompt": [1, 2], "max_tokens": 1}).encode()
    deep = [b"[" * 100_000, b'{"model": "tiny", "prompt": [1, 2], "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"]
    # Deep, but within what the parser takes: parsed, then refused by the field's own check (its message prints it).
    deep += [b'{"model": "tiny", "prompt": [1, 2], "temperature": ' + b"[" * 900 + b"]" * 900 + b"}"]
    results = post_raw(server, deep + [valid])
    for status, error in results[:-1]:
        assert status == 400 and error["type"] == "invalid_request_error", (status, error)
    assert all("too deeply" in error["message"] for _, error in results[:2])
    assert results[2][1]["param"] == "temperature"
    assert results[-1][0] == 200, "the same connection still serves"


def test_an_integer_of_more_digits_than_python_converts_gets_a_400(server):
    body = b'{"model": "tiny", "prompt": [1, 2], "seed": 1' + b"0" * 5000 + b"}"
    status, error = post_raw(server, [body])[0]
    assert status == 400 and "not valid JSON" in error["message"]


# ---- 8: cached_tokens as a prefix oracle -------------------------------------------------------------------------


def cached_tokens(url: str, ids: list[int], tenant: str, stream: bool) -> int:
    client = openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)
    kwargs = dict(model="tiny", prompt=ids, max_tokens=1, temperature=0, extra_headers={"X-Tenant": tenant})
    if not stream:
        return client.completions.create(**kwargs).usage.prompt_tokens_details.cached_tokens
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    return chunks[-1].usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_report_cached_tokens_off_says_0_where_the_cache_hit(llm, server, stream):
    with BackgroundServer(create_app(llm, tenant_header="X-Tenant", report_cached_tokens=False)) as quiet:
        for url, reported, seed in ((server.url, 32, 60 + stream), (quiet.url, 0, 70 + stream)):
            ids, tenant = prompt(48, seed=seed), f"victim-{seed}"
            assert cached_tokens(url, ids, tenant, stream) == 0
            assert cached_tokens(url, ids, tenant, stream) == reported
            (hit,) = llm.generate([ids], max_new_tokens=1, tenant=tenant)
            assert hit.cached_tokens == 32, "the cache itself still hits"


def test_serve_help_says_a_trusted_proxy_sets_the_tenant_header(capsys):
    from ttftc.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "A trusted proxy in front of the server must set this header (or strip it)" in text
    assert "--no-report-cached-tokens" in text


@pytest.mark.parametrize("flag, reported", [([], True), (["--no-report-cached-tokens"], False)])
def test_serve_passes_no_report_cached_tokens_to_the_app(monkeypatch, flag, reported):
    import ttftc.llm
    import ttftc.serve
    from ttftc.cli import main

    apps = []
    monkeypatch.setattr(ttftc.llm, "LLM", lambda *args, **kwargs: SimpleNamespace(name="tiny", notes=[]))
    monkeypatch.setattr(ttftc.serve, "create_app", lambda llm, **kwargs: apps.append(kwargs) or "app")
    monkeypatch.setattr(ttftc.serve, "run_server", lambda app, **kwargs: 0)
    assert main(["serve", "tiny", "--tenant-header", "X-Tenant", *flag]) == 0
    assert [{key: app[key] for key in ("tenant_header", "report_cached_tokens")} for app in apps] == [
        {"tenant_header": "X-Tenant", "report_cached_tokens": reported}]


# ---- issue 40: the HTTP boundary ---------------------------------------------------------------------------------
# Bodies refused by size while they stream in, requests that never finish, echoed values, the drain's count, and
# integer fields that take only integers.


class BodyCounter:
    """ASGI middleware: how many body bytes the app received (`read`) and the statuses it answered."""

    read = 0
    statuses: list = []

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def counted_receive():
            message = await receive()
            if message["type"] == "http.request":
                BodyCounter.read += len(message.get("body", b""))
            return message

        async def noted_send(message):
            if message["type"] == "http.response.start":
                BodyCounter.statuses.append(message["status"])
            await send(message)

        await self.app(scope, counted_receive, noted_send)


def raw_request(host: str, port: int, head: bytes, timeout_s: float = TIMEOUT_S) -> socket.socket:
    connection = socket.create_connection((host, port), timeout=timeout_s)
    connection.sendall(head)
    return connection


def read_to_close(connection: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a reset counts as a close)."""
    received = b""
    try:
        while chunk := connection.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    finally:
        connection.close()
    return received


def test_a_chunked_upload_over_the_limit_gets_a_413_having_read_at_most_the_limit_and_a_chunk(llm):
    from ttftc.serve.app import MAX_BODY_BYTES

    app = create_app(llm)
    app.add_middleware(BodyCounter)
    BodyCounter.read, BodyCounter.statuses = 0, []
    chunk = b"x" * (1 << 20)
    with BackgroundServer(app) as server:
        connection = raw_request(server.host, server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:  # four times the limit, with no Content-Length: only counting what arrives can refuse it
            for _ in range(4 * MAX_BODY_BYTES // len(chunk)):
                connection.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            connection.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_to_close(connection)
        assert BodyCounter.statuses == [413], (BodyCounter.statuses, answer[:200])
        # uvicorn hands the app at most what one read returned beyond its 64 KiB buffer: far below a 1 MiB slack
        assert MAX_BODY_BYTES < BodyCounter.read <= MAX_BODY_BYTES + (1 << 20), BodyCounter.read


def test_a_content_length_over_the_limit_gets_a_413_before_any_of_the_body_is_sent(server):
    connection = raw_request(server.host, server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 500000000\r\n\r\n")
    try:
        head = connection.recv(65536)  # the old server waited here for a body that never comes
    finally:
        connection.close()
    assert head.startswith(b"HTTP/1.1 413 "), head[:200]


def test_requests_that_never_finish_are_closed_at_the_request_timeout_and_finished_ones_are_not(llm):
    from ttftc.serve.timeouts import HTTPTimeouts

    unfinished = [b"",  # a connection opened and left silent
                  b"POST /v1/compl",  # half a request line
                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ",  # headers that never end
                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\""]  # short body
    with BackgroundServer(create_app(llm), timeouts=HTTPTimeouts(request_s=1.0, keep_alive_s=1.0)) as server:
        connections = [raw_request(server.host, server.port, head, timeout_s=30) for head in unfinished]
        # Closed without a response; the old server left each open for ever (here: its 30 s socket timeout raised).
        assert [read_to_close(connection) for connection in connections] == [b""] * len(unfinished)
        # A request that arrived whole is never timed out, however long its answer streams.
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)
        chunks = client.completions.create(model="tiny", prompt=prompt(8), max_tokens=200, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        time.sleep(2.0)  # past the 1 s request timeout before the first chunk is read
        received = list(chunks)
        assert sum(len(c.choices[0].model_extra["token_ids"]) for c in received if c.choices) == 200


def test_a_request_pipelined_behind_an_answered_one_still_has_the_request_timeout(llm):
    """The second request of one packet starts from uvicorn's buffer once the first is answered, not from a read:
    its trickling body is timed all the same (the old guard armed only on reads, so it stayed open)."""
    from ttftc.serve.timeouts import HTTPTimeouts

    pipelined = (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    with BackgroundServer(create_app(llm), timeouts=HTTPTimeouts(request_s=1.0, keep_alive_s=600.0)) as server:
        connection = raw_request(server.host, server.port, pipelined, timeout_s=60)
        received = read_to_close(connection)  # a socket timeout here (60 s) would be the bypass
    assert received.startswith(b"HTTP/1.1 200 ") and received.count(b"HTTP/1.1 ") == 1, received[:300]


def test_the_request_and_keep_alive_timeouts_are_options_of_ttftc_serve(monkeypatch):
    import ttftc.llm
    import ttftc.serve
    from ttftc.cli import main
    from ttftc.serve.timeouts import HTTPTimeouts

    runs = []
    monkeypatch.setattr(ttftc.llm, "LLM", lambda *args, **kwargs: SimpleNamespace(name="tiny", notes=[]))
    monkeypatch.setattr(ttftc.serve, "create_app", lambda llm, **kwargs: "app")
    monkeypatch.setattr(ttftc.serve, "run_server", lambda app, **kwargs: runs.append(kwargs) or 0)
    assert main(["serve", "tiny", "--request-timeout", "2.5", "--keep-alive-timeout", "7"]) == 0
    assert main(["serve", "tiny"]) == 0
    assert [run["timeouts"] for run in runs] == [HTTPTimeouts(2.5, 7.0), HTTPTimeouts()]
    with pytest.raises(ValueError, match="request_s must be a positive number"):
        HTTPTimeouts(request_s=0)


def test_a_megabyte_value_comes_back_shortened_in_its_error(server):
    huge = "m" * (1 << 20)
    bodies = [{"model": huge, "prompt": [1, 2]},  # quoted by the server itself
              {"model": "tiny", "prompt": [1, 2], huge: 1},  # an unknown field: in the message and in `param`
              {"model": "tiny", "prompt": [1, 2], "top_p": huge},  # quoted by GenerationParams (ttftc.llm)
              {"model": "tiny", "prompt": [1, 2], "n": [huge]}]
    for status, error in post_raw(server, [json.dumps(body).encode() for body in bodies]):
        assert status == 400, error
        assert len(error["message"]) < 2000, len(error["message"])  # the old server sent the megabyte back
        assert re.search(r"… \(104\d{4} chars\)", error["message"]), error["message"][:300]
        assert error["param"] is None or len(error["param"]) < 200


@pytest.mark.parametrize("field, value", [("n", True), ("best_of", True), ("n", 1.0), ("max_tokens", True),
                                          ("max_tokens", 4.0), ("priority", 1.0), ("priority", True),
                                          ("top_k", False), ("seed", True), ("stop_token_ids", False),
                                          ("stop_token_ids", [True]), ("echo", 0), ("presence_penalty", False),
                                          ("logprobs", False)])
def test_integer_and_boolean_fields_take_only_their_own_json_type(client, field, value):
    error = bad_request(lambda: client.completions.create(model="tiny", prompt=[1, 2], extra_body={field: value}))
    assert error["param"] == field, error


@pytest.mark.parametrize("field, value", [("max_completion_tokens", True), ("top_logprobs", False), ("n", True)])
def test_chat_integer_fields_take_only_integers(client, field, value):
    error = bad_request(lambda: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body={field: value}))
    assert error["param"] == field, error


def test_the_neutral_values_of_integer_and_boolean_fields_are_still_served(client):
    out = client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, n=1, echo=False, logprobs=0,
                                    presence_penalty=0.0, frequency_penalty=0, extra_body={"top_k": 0,
                                                                                           "priority": 3})
    assert len(out.choices[0].model_extra["token_ids"]) >= 1


def test_a_drain_that_cuts_a_stream_off_counts_it_and_the_client_reads_why(llm):
    app = create_app(llm)
    cut_server = BackgroundServer(app, drain_timeout_s=0.0).start()
    client = openai.OpenAI(base_url=cut_server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)
    chunks = iter(client.completions.create(model="tiny", prompt=prompt(8), max_tokens=1500, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    next(chunks)
    stopping = threading.Thread(target=cut_server.stop)
    stopping.start()
    with pytest.raises(openai.APIError, match="drain timeout ended this request"):
        list(chunks)  # the old server dropped the connection mid-chunk (httpx.RemoteProtocolError)
    stopping.join(TIMEOUT_S)
    served = app.state.served
    assert served.cut_off == 1 and not served.flights
    assert metric(served.metrics.render().decode(), "ttftc_requests_total", 'finish_reason="cut_off"') == 1
    wait_until(lambda: llm._loop.running == 0, timeout_s=TIMEOUT_S, what="the cut request to leave the engine")
