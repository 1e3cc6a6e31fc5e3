"""The fleet on Ray Serve: N `FleetReplica` deployments (one `ttftc.LLM` each, with its own prefix cache) behind a
`FleetIngress` deployment that Ray Serve's HTTP proxy serves.

Each replica is its own one-replica deployment, named `replica-<i>`, so the ingress can send a request to the
replica its router chose (routing.py) with that deployment's handle, and Ray Serve restarts a replica that dies
under the same name. A replica answers with ttftc's own FastAPI app, run in-process (asgi.py), so the routes,
errors, streaming, tenant header, SLO admission and priorities are the single server's. The ingress adds
`x-ttftc-replica` to every response, and serves /metrics itself: the replicas' series, labelled per replica, plus its
routing counters (metrics.py).

Faults: a replica that cannot be reached is taken out of the ring for `RoutingConfig.recheck_s`, then probed (a
`ping`) before a request is sent to it again. A request whose replica fails before its response started is retried
once on another replica; one that fails mid-stream ends with an error event and `[DONE]`, as a drained stream does.

This is the only ttftc module that imports Ray: `ttftc serve` imports it only with --replicas.
"""

# No `from __future__ import annotations` here: FastAPI reads the ingress methods' annotations (Request) as
# objects, and Ray Serve's ingress rewrites those methods where a string annotation no longer resolves.

import asyncio
import collections
import json
import logging
import os
import signal
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import ray
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

import ttftc.llm
import ttftc.serve
from ttftc.fleet.asgi import ForwardedRequest, ResponseStart, call_app, forwarded_headers
from ttftc.fleet.metrics import merge, routing_metrics
from ttftc.fleet.routing import Router, RoutingConfig, routing_key
from ttftc.serve import sse
from ttftc.serve.app import MAX_BODY_BYTES
from ttftc.serve.errors import error_body
from ttftc.serving_config import ServingConfig

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-ttftc-replica"
APP_NAME = "ttftc-fleet"
PROBE_TIMEOUT_S = 2.0  # a replica out of the ring must answer a ping this fast to rejoin it
METRICS_TIMEOUT_S = 5.0  # a replica slower than this to report is left out of one /metrics answer
# Requests Ray Serve lets into one replica (or the ingress) at once: the engine's scheduler queues and admits them
# (max_running, the SLO), so Ray's own limit (5 by default) must not be what queues them.
MAX_ONGOING_REQUESTS = 4096
# A replica whose model fails to load fails the same way again: the fleet gives up (and says why) after this many
# tries, not Ray Serve's default 20.
CONSTRUCTOR_RETRIES = 2


@dataclass(frozen=True)
class FleetSpec:
    """What a fleet serves and how. llm_kwargs are ServingConfig's fields (checked here, on the driver, before Ray
    starts anything), for `ttftc.LLM(model, **llm_kwargs)` in each replica; app_kwargs go to
    `ttftc.serve.create_app` (tenant_header, report_cached_tokens, policy, warm); threads_per_replica: torch's
    intra-op threads in each replica, also the CPUs Ray reserves for it."""

    model: str
    replicas: int
    llm_kwargs: dict = field(default_factory=dict)
    app_kwargs: dict = field(default_factory=dict)
    routing: RoutingConfig = RoutingConfig()
    threads_per_replica: int = 1
    drain_timeout_s: float = 30.0

    def __post_init__(self):
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be a positive int, got {self.replicas!r}")
        if not isinstance(self.threads_per_replica, int) or self.threads_per_replica < 1:
            raise ValueError(f"threads_per_replica must be a positive int, got {self.threads_per_replica!r}")
        ServingConfig(**self.llm_kwargs)  # a bad setting fails here, not in every replica

    @property
    def replica_names(self) -> list[str]:
        return [f"replica-{i}" for i in range(self.replicas)]


class FleetReplica:
    """One replica: a `ttftc.LLM` and the single server's app over it (module docstring)."""

    def __init__(self, replica_id: str, spec: FleetSpec):
        torch.set_num_threads(spec.threads_per_replica)
        self.replica_id = replica_id
        kwargs = {**spec.llm_kwargs, "on_progress": self._progress}
        # kv_disk: every replica opens the one directory given. The disk tier is shared by processes
        # (runtime/kv_disk.py): a replica finds the blocks the others wrote, a new or restarted replica starts warm
        # from all of them, and kv_disk_bytes is the budget of the whole directory, not of each replica.
        self._drain_timeout_s = spec.drain_timeout_s
        self.llm = ttftc.llm.LLM(spec.model, **kwargs)
        try:
            self.app = ttftc.serve.create_app(self.llm, **spec.app_kwargs)
        except BaseException:  # warm prompts that do not fit, say: Ray Serve reports it; the engine stops here
            self.llm.close(drain_timeout_s=0)
            self.llm = None
            raise

    def _progress(self, line: str) -> None:
        print(f"ttftc serve [{self.replica_id}]: {line}", file=sys.stderr, flush=True)

    async def forward(self, request: ForwardedRequest):
        async for item in call_app(self.app, request):
            yield item

    def ping(self) -> str:
        return self.replica_id

    def pid(self) -> int:  # the replica's process, for an operator (or a test) to find it
        return os.getpid()

    def __del__(self):  # Ray Serve stops the replica (shutdown, scale down): stop its engine thread
        llm = getattr(self, "llm", None)
        if llm is not None:
            self.app.state.served.draining = True
            llm.close(drain_timeout_s=self._drain_timeout_s)
            self.llm = None


# _read_body and _Once come before FleetIngress: Ray Serve pickles the ingress's routes when the class is decorated,
# with the module globals its methods name that exist by then.
async def _read_body(request: Request) -> Optional[bytes]:
    """The body, or None as soon as it exceeds the single server's limit: the ingress holds no more of an oversized
    upload than a replica would, and ships none of it through Ray."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > MAX_BODY_BYTES):
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return None
    return bytes(body)


class _Once:
    """A callback that runs at most once, whichever of its callers comes first."""

    def __init__(self, callback: Callable[[], None]):
        self._callback: Optional[Callable[[], None]] = callback

    def __call__(self) -> None:
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


ingress_app = FastAPI(title="ttftc fleet", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(ingress_app)
class FleetIngress:
    """Receives every request, picks its replica (routing.py), forwards it and relays the response."""

    def __init__(self, replicas: list, spec: FleetSpec):
        names = spec.replica_names
        self.handles = dict(zip(names, replicas))
        self.streams = {name: handle.options(stream=True) for name, handle in self.handles.items()}
        self.router = Router(names, spec.routing)
        self.tenant_header = spec.app_kwargs.get("tenant_header")
        self.routed: collections.Counter = collections.Counter()

    @ingress_app.get("/metrics")
    async def metrics(self):
        names = [n for n, state in self.router.replicas.items() if state.healthy]
        texts = await asyncio.gather(*(self._metrics_of(n) for n in names))
        merged = merge({n: t for n, t in zip(names, texts) if t is not None})
        return Response(merged + routing_metrics(self.router, self.routed),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _metrics_of(self, name: str) -> Optional[str]:
        request = ForwardedRequest("GET", "/metrics", "", (), b"")
        try:
            start, body = await asyncio.wait_for(self._whole(self.streams[name].forward.remote(request)),
                                                 METRICS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a replica down or slow: its series pause (metrics.py)
            return None
        return body.decode() if start.status == 200 else None

    @staticmethod
    async def _whole(stream) -> tuple[ResponseStart, bytes]:
        start, chunks = None, []
        async for item in stream:
            if isinstance(item, ResponseStart):
                start = item
            else:
                chunks.append(item)
        return start, b"".join(chunks)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def forward(self, request: Request, path: str):
        body = await _read_body(request)
        if body is None:
            return JSONResponse(error_body(f"the request body is larger than {MAX_BODY_BYTES} bytes"),
                                status_code=413)
        key = None
        if request.method == "POST" and self.router.config.routing == "prefix":
            try:
                parsed = json.loads(body)
            except (ValueError, RecursionError):  # the replica answers its 400; any replica will do
                parsed = None
            tenant = request.headers.get(self.tenant_header) if self.tenant_header else None
            key = routing_key(parsed, tenant or None, self.router.config.prefix_tokens)
        forwarded = ForwardedRequest(request.method, "/" + path, request.url.query,
                                     tuple(request.headers.items()), body)
        tried: list[str] = []
        failures = 0
        while failures < 2:  # the chosen replica, and one retry elsewhere (a failed probe costs no retry)
            choice = self.router.choose(key, exclude=tried)
            if choice is None:
                break
            name = choice.replica
            tried.append(name)
            if not self.router.replicas[name].healthy and not await self._probe(name):
                continue
            self.router.started(name)
            stream = self.streams[name].forward.remote(forwarded)
            try:
                start = await stream.__anext__()
            except Exception as exc:  # noqa: BLE001 - the replica died or could not be reached
                self.router.finished(name)
                self.router.failed(name)
                failures += 1
                log.warning("replica %s failed before responding (%s: %s); %s", name, type(exc).__name__, exc,
                            "retrying elsewhere" if failures < 2 else "giving up")
                continue
            self.routed[(name, choice.reason)] += 1
            return await self._respond(name, start, stream)
        return JSONResponse(error_body("no replica of this fleet could serve the request; retry shortly",
                                       type="server_error", code="no_replica"), status_code=503,
                            headers={"Retry-After": "1"})

    async def _probe(self, name: str) -> bool:
        try:
            await asyncio.wait_for(self.handles[name].ping.remote(), PROBE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - still down
            self.router.failed(name)
            return False
        self.router.recovered(name)
        return True

    async def _respond(self, name: str, start: ResponseStart, stream):
        headers = {**forwarded_headers(start.headers), REPLICA_HEADER: name}
        if dict(start.headers).get("content-type", "").startswith("text/event-stream"):
            release = _Once(lambda: self.router.finished(name))
            relay = self._relay(name, stream, release)
            # A client that leaves before the body starts leaves the relay unstarted, so its `finally` never runs:
            # its collection then releases the replica's count instead.
            weakref.finalize(relay, release)
            return StreamingResponse(relay, status_code=start.status, headers=headers)
        try:
            chunks = [chunk async for chunk in stream]
        except Exception as exc:  # noqa: BLE001
            self.router.failed(name)
            return JSONResponse(error_body(f"replica {name} failed before its response was complete "
                                           f"({type(exc).__name__})", type="server_error", code="replica_failed"),
                                status_code=502, headers={REPLICA_HEADER: name})
        finally:
            self.router.finished(name)
        return Response(b"".join(chunks), status_code=start.status, headers=headers)

    async def _relay(self, name: str, stream, release: Callable[[], None]):
        done = False
        try:
            async for chunk in stream:
                yield chunk
            done = True
        except Exception as exc:  # noqa: BLE001 - a clean end for the client: why, then [DONE]
            self.router.failed(name)
            done = True
            yield sse.event(error_body(f"replica {name} failed mid-response ({type(exc).__name__}); retry the "
                                       "request", type="server_error", code="replica_failed"))
            yield sse.DONE
        finally:
            release()
            if not done:  # the client left: cancel the replica's side too, freeing its KV and slot
                stream.cancel()


def build_app(spec: FleetSpec):
    """The Ray Serve application: the replicas and the ingress over them, bound, not yet running."""
    replica = serve.deployment(FleetReplica)
    replicas = [replica.options(name=name, num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                                max_constructor_retry_count=CONSTRUCTOR_RETRIES,
                                graceful_shutdown_timeout_s=spec.drain_timeout_s,
                                ray_actor_options={"num_cpus": spec.threads_per_replica}).bind(name, spec)
                for name in spec.replica_names]
    ingress = serve.deployment(FleetIngress).options(name="ingress", num_replicas=1,
                                                      max_ongoing_requests=MAX_ONGOING_REQUESTS,
                                                      ray_actor_options={"num_cpus": 0})
    return ingress.bind(replicas, spec)


class Fleet:
    """A running fleet: `url`, and `stop()` (which also stops the local Ray cluster this fleet started)."""

    def __init__(self, spec: FleetSpec, *, host: str = "127.0.0.1", port: int = 8000,
                 ray_address: Optional[str] = None, num_cpus: Optional[int] = None):
        self.spec = spec
        self.url = f"http://{host}:{port}"
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            if ray_address:
                ray.init(address=ray_address, log_to_driver=True)
            else:
                cpus = num_cpus if num_cpus is not None else max(os.cpu_count() or 1,
                                                                  spec.replicas * spec.threads_per_replica)
                ray.init(num_cpus=cpus, include_dashboard=False)
        try:
            serve.start(http_options={"host": host, "port": port})
            serve.run(build_app(spec), name=APP_NAME, route_prefix="/")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        try:
            serve.shutdown()
        finally:
            if self._started_ray:
                ray.shutdown()

    def __enter__(self) -> 'Fleet':
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_until_signalled(fleet: Fleet) -> None:
    """Block until Ctrl-C or SIGTERM (the replicas drain as Ray Serve stops them: FleetReplica.__del__)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        fleet.stop()

