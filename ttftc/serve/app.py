"""The FastAPI app: OpenAI's completions and chat endpoints over a `ttftc.LLM`, plus models, health and metrics.

    app = create_app(llm, tenant_header="X-Tenant", report_cached_tokens=True,
                     policy=ServingPolicy(tenant_priorities={"batch": 5}, slo_ttft_ms=700))

Each request is validated in full before anything is queued, so a bad one gets its 400 (OpenAI's error shape)
and costs the engine nothing. The prompt then goes to the LLM's engine thread; its tokens come back to this
event loop through `call_soon_threadsafe` and leave as server-sent events. A client that disconnects has its
request cancelled, which frees its KV and its slot.

The tenant (the prefix-cache namespace) comes only from the header the operator named; without one configured,
or without the header on a request, the request runs as PRIVATE: it shares no cached prefix with any other
request. It never falls back to the LLM's default namespace, which belongs to in-process callers.

`usage.prompt_tokens_details.cached_tokens` tells a client how much of its prompt was served from the cache, so
whoever can set the tenant header can test guesses of what that tenant's prompts begin with (a cache block at a
time): the header must be set (or stripped) by a trusted proxy. `report_cached_tokens=False` reports 0 instead
(TTFT still tells a cached prefix from a cold one, more noisily).

Every request gets a TTFT estimate before it is queued (runtime/ttft_estimate.py: a cost model fitted online from
the engine's forwards, replayed over the work queued ahead of it in priority order), sent back as the header
`x-ttftc-estimated-ttft-ms` (milliseconds from the request's arrival at its handler) and recorded in /metrics
beside the TTFT it got. The policy (serve/policy.py) sets the priorities each tenant may ask for (a 400
outside them) and, with an SLO, refuses at once (HTTP 429 in OpenAI's shape, with `Retry-After`, the seconds
until the queue is estimated to drain) a request whose estimate misses the SLO by more than its margin.

/health answers ok once the model is loaded, also while an LLM made with `background_compile=True` (as `ttftc
serve` makes it) still compiles its buckets: requests are served meanwhile, on the KV path where a bucket is not
ready; `buckets_compiling` in its body and the gauges in /metrics tell how far the compile got, and `warm` turns
true once every graph the server uses is ready (the KV path's included).

`warm_prompts` (serve/warm.py) are prefilled into the prefix cache and pinned there before `create_app` returns,
so a server never reports healthy without them; a bad one raises WarmPromptsError and no app is made.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException

from ttftc.llm import LLM, ParamError, RequestOutput
from ttftc.runtime.engine_loop import EngineClosedError, TokenEvent
from ttftc.runtime.prefix_cache import PRIVATE, Tenant
from ttftc.serve import sse
from ttftc.serve.errors import APIError, bad_request, echo, error_body, shorten
from ttftc.serve.metrics import CONTENT_TYPE, ServerMetrics
from ttftc.serve.policy import PriorityRefused, ServingPolicy
from ttftc.serve.warm import WarmPrompt, Warmed, warm_prompts
from ttftc.serve.protocol import GenerationRequest, parse_chat, parse_completion
from ttftc.text import NoTokenizerError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
_GONE = object()  # put on a request's event queue when its client disconnects
_CUT = object()  # put on a request's event queue when the drain timeout ends it (server.py)
ESTIMATE_HEADER = "x-ttftc-estimated-ttft-ms"
_CUT_MESSAGE = "the server is shutting down and its drain timeout ended this request before it finished"


def create_app(llm: LLM, *, tenant_header: Optional[str] = None, model_name: Optional[str] = None,
               report_cached_tokens: bool = True, policy: Optional[ServingPolicy] = None,
               warm: Sequence[WarmPrompt] = ()) -> FastAPI:
    policy = policy if policy is not None else ServingPolicy()
    if policy.tenant_priorities and not tenant_header:
        raise ValueError("tenant priorities need a tenant header (tenant_header=..., --tenant-header NAME): without "
                         "one no request names a tenant")
    if warm and not tenant_header:
        raise ValueError("warm prompts need a tenant header (tenant_header=..., --tenant-header NAME): requests "
                         "without one share no cache, so none could hit a warm prompt")
    warmed = warm_prompts(llm, warm, require_tenant=True)
    app = FastAPI(title="ttftc", docs_url=None, redoc_url=None, openapi_url=None)
    served = _Served(llm, model_name or llm.name, tenant_header, report_cached_tokens, policy)
    served.warmed = warmed
    app.state.served = served

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        served.metrics.errors.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        served.metrics.errors.labels(str(exc.status_code)).inc()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {shorten(request.url.path)}: {exc.detail}", type=kind),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        served.metrics.errors.labels("500").inc()
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type="server_error"), status_code=500)

    @app.get("/health")
    async def health():
        if served.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        status = llm.compile_status()
        return {"status": "ok", "buckets_compiling": status["buckets_compiling"], "warm": status["warm"]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served.model_card()]}

    @app.get("/metrics")
    async def metrics():
        return Response(served.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await served.handle(request, parse_completion, lambda parsed: llm.encode(parsed.prompt), "prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await served.handle(request, parse_chat, lambda parsed: llm.encode_chat(parsed.messages), "messages")

    return app


async def _parse(request: Request, parse) -> GenerationRequest:
    body = await _read_body(request)
    try:
        try:
            value = json.loads(body)
        except ValueError as exc:  # not UTF-8, not JSON, or an integer of more digits than Python converts
            raise bad_request(f"the request body is not valid JSON: {exc}") from None
        return parse(value)
    except RecursionError:  # json.loads, and the repr of a value in an error message, recurse once per level
        raise bad_request("the request body nests JSON arrays or objects too deeply; an OpenAI request needs only a "
                          "few levels") from None


async def _read_body(request: Request) -> bytes:
    """The body, refused (413) as soon as it is known to exceed MAX_BODY_BYTES: by its Content-Length before any of
    it is read, else while it streams in (a chunked upload declares no length), so an oversized upload holds at
    most the limit plus one chunk in memory. uvicorn discards whatever the client still sends of it, until the
    request timeout (serve/timeouts.py) ends the connection."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > MAX_BODY_BYTES):
        raise _too_large()
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise _too_large()
    except ClientDisconnect:  # the client left, or the request timeout closed its connection: nobody reads this
        raise APIError(499, "the connection closed before the whole request body arrived") from None
    return bytes(body)


def _too_large() -> APIError:
    return APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")


class _Served:
    """What the endpoints share: the LLM, its name, the tenant header, the metrics, the draining flag."""

    def __init__(self, llm: LLM, name: str, tenant_header: Optional[str], report_cached_tokens: bool = True,
                 policy: Optional[ServingPolicy] = None):
        self.llm = llm
        self.name = name
        self.tenant_header = tenant_header
        self.report_cached_tokens = report_cached_tokens
        self.policy = policy if policy is not None else ServingPolicy()
        self.draining = False
        self.flights: set[_Flight] = set()  # responses under way
        self.cut_off = 0  # responses the drain timeout ended before they were whole
        self.created = int(time.time())
        self._estimate_failed = False
        self.warmed = Warmed((), 0)
        self.metrics = ServerMetrics(llm.stats)

    def model_card(self) -> dict:
        geometry = self.llm.geometry
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "ttftc",
                "max_model_len": geometry.max_positions, "vocab_size": geometry.vocab_size,
                "has_tokenizer": self.llm.tokenizer is not None}

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise bad_request(f"the model {echo(model)} does not exist; this server serves {self.name!r}",
                              param="model", code="model_not_found")

    async def handle(self, request: Request, parse, encode, param: str):
        """Parse and check the whole request (a 400 for anything wrong), then generate."""
        arrived = time.perf_counter()
        parsed = await _parse(request, parse)
        self.check_model(parsed.model)
        try:
            ids = encode(parsed)
        except NoTokenizerError as exc:
            raise bad_request(str(exc), param=param, code="no_tokenizer") from None
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from None
        return await self.respond(request, parsed, ids, arrived)

    def cut_off_in_flight(self) -> None:
        """The drain timeout (server.py; on the event loop): end every response still under way. A stream gets an
        error event and its end, so the client reads a clean end rather than a broken connection; a response not
        yet started gets a 503. Their engine requests are cancelled, and each is counted in `cut_off` as it ends."""
        for flight in list(self.flights):
            flight.cut()

    def tenant(self, request: Request) -> Tenant:
        if self.tenant_header is None:
            return PRIVATE
        value = request.headers.get(self.tenant_header)
        return value if value else PRIVATE

    def estimate(self, ids: list[int], tenant: Tenant, priority: int, max_new_tokens: int,
                 arrived: float) -> Optional[tuple[float, float]]:
        """(seconds from `arrived` to the first token, seconds from now until the queue drains), as estimated now;
        None if the estimate failed (the request is served without one rather than refused for it)."""
        try:
            ahead = self.llm.estimate(ids, tenant=tenant, priority=priority, max_new_tokens=max_new_tokens)
        except Exception:
            if not self._estimate_failed:
                log.exception("the TTFT estimate failed; requests are served without one")
                self._estimate_failed = True
            return None
        return (time.perf_counter() - arrived) + ahead.ttft_s, ahead.drain_s

    def admit(self, estimate: Optional[tuple[float, float]], priority: int) -> dict[str, str]:
        """The estimate's header, or a 429 (module docstring) when the policy refuses the request."""
        if estimate is None:
            return {}
        estimated_s, drain_s = estimate
        headers = {ESTIMATE_HEADER: f"{estimated_s * 1e3:.0f}"}
        if self.policy.refuses(estimated_s, priority):
            shed_first = priority > self.policy.shed_priority_above
            self.metrics.shed.labels("shed_first" if shed_first else "protected").inc()
            limit_ms = self.policy.limit_s(priority) * 1e3
            retry = max(1, math.ceil(drain_s))
            raise APIError(
                429, f"the server is overloaded: this request's estimated time to first token is "
                f"{estimated_s * 1e3:.0f} ms, above the {limit_ms:.0f} ms this server admits at priority {priority} "
                f"(TTFT SLO {self.policy.slo_ttft_ms:g} ms); retry after {retry} s",
                type="rate_limit_error", code="slo_ttft_exceeded", headers={**headers, "Retry-After": str(retry)})
        return headers

    async def respond(self, request: Request, parsed: GenerationRequest, ids: list[int], arrived: float):
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="draining")
        tenant = self.tenant(request)
        try:
            priority = self.policy.priority(tenant, parsed.priority)
        except PriorityRefused as exc:  # a privilege the tenant lacks: refused, never clamped (serve/policy.py)
            raise bad_request(str(exc), param="priority", code="priority_not_allowed") from None
        try:
            self.llm.check_length(ids, parsed.params.max_new_tokens)  # a 400 before any 429
        except ParamError as exc:
            raise bad_request(str(exc), param=exc.param) from None
        estimate = self.estimate(ids, tenant, priority, parsed.params.max_new_tokens, arrived)
        headers = self.admit(estimate, priority)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(event) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (server stopped): nobody is listening
                pass

        try:
            output = self.llm.open(ids, parsed.params, sink, tenant=tenant, priority=priority, arrived_at=arrived)
        except ParamError as exc:
            raise bad_request(str(exc), param=exc.param) from None
        except EngineClosedError:
            raise APIError(503, "the server is shutting down", type="server_error", code="draining") from None
        except ValueError as exc:
            raise bad_request(str(exc), param="prompt") from None
        flight = _Flight(self, request, output, events, None if estimate is None else estimate[0])
        shape = sse.ResponseShape(parsed.kind, self.name, report_cached_tokens=self.report_cached_tokens)
        if parsed.stream:
            return StreamingResponse(self._stream(flight, shape, parsed.include_usage, arrived),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        return await self._whole(flight, shape, arrived, headers)

    async def _stream(self, flight: "_Flight", shape: sse.ResponseShape, include_usage: bool, arrived: float):
        output = flight.output
        last_sent = None
        try:
            while not output.done:
                event = await flight.events.get()
                if event is _GONE:
                    return
                if event is _CUT:
                    yield sse.event(error_body(_CUT_MESSAGE, type="server_error", code="draining"))
                    yield sse.DONE
                    return
                delta = output.on_event(event)
                if delta is None or not (delta.token_ids or delta.text):
                    continue
                yield sse.event(shape.chunk(delta.text, delta.token_ids))
                if isinstance(event, TokenEvent):
                    last_sent = self._observe_token(flight, arrived, last_sent)
            completion = output.completion()
            if completion.finish_reason == "error":
                yield sse.event(error_body(f"generation failed: {completion.error}", type="server_error"))
            else:
                yield sse.event(shape.chunk("", [], completion.finish_reason))
                if include_usage:
                    yield sse.event(shape.usage_chunk(completion))
            yield sse.DONE
            flight.delivered = True  # resumed after the server wrote the end: the whole stream left
        finally:
            flight.close()

    async def _whole(self, flight: "_Flight", shape: sse.ResponseShape, arrived: float, headers: dict[str, str]):
        output = flight.output
        last_seen = None
        try:
            while not output.done:
                event = await flight.events.get()
                if event is _GONE:
                    return Response(status_code=499)
                if event is _CUT:
                    raise APIError(503, _CUT_MESSAGE, type="server_error", code="draining")
                output.on_event(event)
                if isinstance(event, TokenEvent):
                    last_seen = self._observe_token(flight, arrived, last_seen)
            flight.delivered = True  # the whole completion is in hand; nothing can cut it now
        finally:
            flight.close()
        completion = output.completion()
        if completion.finish_reason == "error":
            raise APIError(500, f"generation failed: {completion.error}", type="server_error")
        return JSONResponse(shape.whole(completion), headers=headers)

    def _observe_token(self, flight: "_Flight", arrived: float, last: Optional[float]) -> float:
        now = time.perf_counter()
        if last is None:
            self.metrics.first_token(now - arrived, flight.estimated_s)
        else:
            self.metrics.itl.observe(now - last)
        return now


class _Flight:
    """One request between the engine and its client: the events the engine sends, and a watch on the connection
    that cancels the request (freeing its KV and its slot) the moment the client leaves, whether tokens are
    flowing or not, streamed or not, even before a streamed response started."""

    def __init__(self, served: _Served, request: Request, output: RequestOutput, events: asyncio.Queue,
                 estimated_s: Optional[float] = None):
        self.served = served
        self.output = output
        self.events = events
        self.estimated_s = estimated_s  # the TTFT estimated at admission, from the handler's arrival
        self.delivered = False  # the response was complete before it ended
        self._cut = False
        self._closed = False
        self._watch = asyncio.create_task(self._watch_client(request))
        served.flights.add(self)

    async def _watch_client(self, request: Request) -> None:
        # The body is read: the server's receive() now returns only when the client disconnects (or the response
        # is complete, by which time close() has cancelled this watch).
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.events.put_nowait(_GONE)  # wakes the response's loop, which ends at once
        self.close()

    def cut(self) -> None:
        """The drain timeout: the response's loop ends at this event (or uvicorn cancels it later, if the client
        does not read); either way close() counts it as cut off unless it was delivered whole first."""
        self._cut = True
        self.events.put_nowait(_CUT)

    def close(self) -> None:
        """Runs once, however the response ended; a request still in the engine is cancelled."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not asyncio.current_task():
            self._watch.cancel()
        served, output = self.served, self.output
        served.flights.discard(self)
        if self._cut and not self.delivered:
            served.cut_off += 1
        if not output.done:
            served.llm.cancel(output.request_id)
            served.metrics.requests.labels("cut_off" if self._cut else "disconnected").inc()
            return
        served.metrics.finished(output.completion())

