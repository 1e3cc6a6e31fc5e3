"""Issue 40, item 3: priority is a privilege. Over HTTP, a request without a tenant header cannot ask to run ahead
of a default request (a 400 naming the allowed range, not a silent clamp); a tenant whose range allows it can.
The scheduler side (bounded aging, no inversion) is tests/runtime/test_priority_aging.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

import ttftc
from tests.serve.helpers import submitted_priorities
from ttftc.serve import BackgroundServer, create_app
from ttftc.serve.policy import PriorityFileError, PriorityRange, ServingPolicy, read_priority_file

BEST = -(2**31)


@pytest.fixture(scope="module")
def served():
    llm = ttftc.LLM("tiny", precision="fp32", buckets=None, max_batch_tokens=256, batch_window_ms=0.0,
                    compile_kv_path=False)
    policy = ServingPolicy(tenant_priorities={"ops": PriorityRange(BEST, 10)})
    server = BackgroundServer(create_app(llm, tenant_header="X-Tenant", policy=policy)).start()
    yield llm, server
    server.stop()
    llm.close(drain_timeout_s=5)


def post(server, body: dict, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("headers", [{}, {"X-Tenant": "not-listed"}])
def test_without_a_listed_tenant_the_best_priority_gets_a_400_naming_the_range(served, monkeypatch, headers):
    llm, server = served
    submitted = submitted_priorities(monkeypatch, llm)
    for priority in (BEST, -1):
        status, body = post(server, {"model": llm.name, "prompt": [1, 2, 3], "max_tokens": 1,
                                     "priority": priority}, headers)
        assert status == 400, body
        error = body["error"]
        assert error["param"] == "priority" and error["code"] == "priority_not_allowed"
        assert f"priority {priority} is outside" in error["message"] and "0 to 2147483647" in error["message"]
    assert submitted == []  # refused before anything was queued
    status, _ = post(server, {"model": llm.name, "prompt": [1, 2, 3], "max_tokens": 1, "priority": 3}, headers)
    assert status == 200 and submitted == [3]


def test_a_tenant_whose_range_allows_it_is_served_at_that_priority(served, monkeypatch):
    llm, server = served
    submitted = submitted_priorities(monkeypatch, llm)
    status, body = post(server, {"model": llm.name, "prompt": [1, 2, 3], "max_tokens": 1, "priority": BEST},
                        {"X-Tenant": "ops"})
    assert status == 200, body
    status, body = post(server, {"model": llm.name, "prompt": [1, 2, 3], "max_tokens": 1, "priority": 11},
                        {"X-Tenant": "ops"})
    assert status == 400 and f"tenant 'ops': {BEST} to 10" in body["error"]["message"]
    assert submitted == [BEST]


def test_a_default_range_reaching_below_0_is_refused():
    with pytest.raises(ValueError, match="must not reach below 0"):
        ServingPolicy(default_priorities=PriorityRange(-1, 5))


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "expected a JSON object"),
    ('{"tenants": {"a": [5, 1]}}', "tenant a: a priority range runs from its best"),
    ('{"tenants": {"a": true}}', "tenant a: a priority range is an integer"),
    ('{"tenants": {"a": [0, 4294967296]}}', "worst must be an integer from"),
    ('{"tenants": []}', '"tenants" must be an object'),
    ('{"default": [-3, 5]}', None),  # parsed; ServingPolicy refuses it (above)
    ('{"defualt": [0, 5]}', "unknown field defualt"),
    ('{"tenants": {"": 1}}', "a tenant name must not be empty"),
    ("[" * 100_000, "not a readable JSON priority file"),
    ("{", "not a readable JSON priority file"),
])
def test_a_priority_file_is_untrusted_data(tmp_path, text, message):
    path = tmp_path / "priorities.json"
    path.write_text(text)
    if message is None:
        default, tenants = read_priority_file(path)
        assert default == PriorityRange(-3, 5) and tenants == {}
        return
    with pytest.raises(PriorityFileError, match=message):
        read_priority_file(path)


def test_a_priority_file_that_is_a_directory_or_huge_is_refused(tmp_path):
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(PriorityFileError, match="not a regular file"):
        read_priority_file(tmp_path / "dir.json")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(1 << 30)  # sparse: refused from its size, before a byte is read
    with pytest.raises(PriorityFileError, match="larger than"):
        read_priority_file(huge)
    good = tmp_path / "good.json"
    good.write_text('{"default": [0, 100], "tenants": {"ops": [-5, 10], "batch": 5}}')
    assert read_priority_file(good) == (PriorityRange(0, 100), {"ops": PriorityRange(-5, 10),
                                                                 "batch": PriorityRange(5)})
