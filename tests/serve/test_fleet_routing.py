"""The fleet's parts that need no Ray: routing (prefix affinity, load fallback, health), the ASGI relay, the merged
/metrics, and `ttftc serve` without --replicas never importing Ray. tests/serve/test_fleet.py runs a real fleet."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ttftc.fleet.asgi import ForwardedRequest, ResponseStart, call_app
from ttftc.fleet.metrics import labelled, merge
from ttftc.fleet.routing import Router, RoutingConfig, routing_key

REPLICAS = ["replica-0", "replica-1", "replica-2"]


def key(ids, tenant="a"):
    return routing_key({"prompt": ids}, tenant, 32)


def test_the_key_covers_tenant_and_prompt_head_only():
    system = list(range(40))
    assert key(system + [1, 2]) == key(system + [9, 9, 9])  # turns after a shared 32-token head share the key
    assert key(system) != key(system, tenant="b")  # the prefix cache is per tenant: so is the key
    assert key([5] + system) != key(system)
    text = "s" * 200
    assert routing_key({"prompt": text + "x"}, "a", 32) == routing_key({"prompt": text + "y"}, "a", 32)
    chat = [{"role": "system", "content": text}]
    assert (routing_key({"messages": chat + [{"role": "user", "content": "hi"}]}, "a", 32)
            == routing_key({"messages": chat + [{"role": "user", "content": "bye"}]}, "a", 32))
    for bad in (None, [], {"prompt": 3}, {"messages": ["x"]}, {"model": "m"}):
        assert routing_key(bad, "a", 32) is None


def test_affinity_is_stable_and_spreads_prefixes_over_replicas():
    router = Router(REPLICAS)
    chosen = {}
    for seed in range(60):
        k = key([seed] * 32)
        first = router.choose(k)
        assert first.reason == "affinity"
        assert all(router.choose(k).replica == first.replica for _ in range(3))
        chosen[seed] = first.replica
    assert set(chosen.values()) == set(REPLICAS)
    # A second router (a restarted ingress) maps every key the same way: the hash is not Python's salted one.
    again = Router(REPLICAS)
    assert all(again.choose(key([seed] * 32)).replica == r for seed, r in chosen.items())


def test_a_replica_leaving_moves_only_its_own_keys():
    router = Router(REPLICAS)
    before = {seed: router.choose(key([seed] * 32)).replica for seed in range(60)}
    router.failed("replica-1")
    after = {seed: router.choose(key([seed] * 32)).replica for seed in range(60)}
    assert "replica-1" not in after.values()
    assert all(after[s] == r for s, r in before.items() if r != "replica-1")


def test_a_busy_preferred_replica_yields_to_the_least_loaded():
    router = Router(REPLICAS, RoutingConfig(imbalance=2))
    k = key(list(range(32)))
    preferred = router.choose(k).replica
    for _ in range(2):
        router.started(preferred)
    assert router.choose(k).replica == preferred  # 2 more in flight than the idlest: still within the imbalance
    router.started(preferred)
    fallback = router.choose(k)
    assert fallback.reason == "load" and fallback.replica != preferred
    for _ in range(3):
        router.finished(preferred)
    assert router.choose(k).replica == preferred


def test_balanced_routing_takes_the_least_loaded_in_turn():
    router = Router(REPLICAS, RoutingConfig(routing="balanced"))
    k = key(list(range(32)))
    seen = []
    for _ in range(3):
        choice = router.choose(k)
        assert choice.reason == "balanced"
        router.started(choice.replica)
        seen.append(choice.replica)
    assert sorted(seen) == REPLICAS  # all idle at first: each gets one
    router.finished("replica-2")
    assert router.choose(k).replica == "replica-2"


def test_a_failed_replica_returns_after_its_recheck_time():
    now = [100.0]
    router = Router(REPLICAS[:2], RoutingConfig(recheck_s=2.0), clock=lambda: now[0])
    router.failed("replica-0")
    assert router.candidates() == ["replica-1"]
    assert router.choose(None).replica == "replica-1"
    router.failed("replica-1")
    assert router.choose(None) is None  # every replica down: the ingress answers 503
    now[0] += 2.0
    assert router.candidates() == REPLICAS[:2]  # due a probe; recovered() puts them back for good
    router.recovered("replica-0")
    assert router.replicas["replica-0"].healthy


@pytest.mark.parametrize("bad", [dict(routing="random"), dict(prefix_tokens=0), dict(imbalance=-1)])
def test_bad_routing_config_is_refused(bad):
    with pytest.raises(ValueError):
        RoutingConfig(**bad)


def test_merged_metrics_label_each_replica_and_group_each_family():
    text = ("# HELP ttftc_x X.\n# TYPE ttftc_x counter\nttftc_x 1.0\nttftc_x_created 5\n"
            "# HELP ttftc_y Y.\n# TYPE ttftc_y gauge\nttftc_y{status=\"400\"} 2.0\n")
    merged = merge({"replica-0": text, "replica-1": text.replace("1.0", "3.0")})
    lines = merged.splitlines()
    assert lines.count("# HELP ttftc_x X.") == 1 and lines.count("# TYPE ttftc_y gauge") == 1
    assert 'ttftc_x{replica="replica-0"} 1.0' in lines and 'ttftc_x{replica="replica-1"} 3.0' in lines
    assert 'ttftc_y{replica="replica-1",status="400"} 2.0' in lines
    # Each family's samples follow its own header, not the other family's.
    assert lines.index('ttftc_x{replica="replica-1"} 3.0') < lines.index("# HELP ttftc_y Y.")
    assert labelled('m{} 1', 'r"1') == 'm{replica="r\\"1"} 1'


def _demo_app(cancelled: list):
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return JSONResponse({"got": (await request.body()).decode(), "tenant": request.headers.get("x-tenant")},
                            status_code=201)

    @app.get("/stream")
    async def stream():
        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(0.001)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_the_asgi_relay_returns_status_headers_body_and_streams():
    cancelled: list = []
    app = _demo_app(cancelled)

    async def whole():
        items = [i async for i in call_app(app, ForwardedRequest("POST", "/echo", "", (("X-Tenant", "t"),), b"hi"))]
        return items

    items = asyncio.run(whole())
    assert isinstance(items[0], ResponseStart) and items[0].status == 201
    assert b"".join(items[1:]) == b'{"got":"hi","tenant":"t"}'

    async def first_three():
        stream = call_app(app, ForwardedRequest("GET", "/stream", "", (), b""))
        got = [await stream.__anext__() for _ in range(4)]
        await stream.aclose()  # the reader leaves: the app must see its client disconnect
        await asyncio.sleep(0.2)
        return got

    got = asyncio.run(first_three())
    assert got[0].status == 200 and got[1:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert cancelled == [True]


def test_serve_without_replicas_never_imports_ray():
    code = ("import sys, ttftc.cli, ttftc.commands.serve_run, ttftc.fleet.routing, ttftc.fleet.metrics, "
            "ttftc.fleet.asgi; assert 'ray' not in sys.modules, 'ray imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
