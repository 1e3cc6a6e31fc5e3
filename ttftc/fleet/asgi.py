"""One HTTP request through an ASGI app in-process, its response streamed back as it is sent.

A fleet replica serves ttftc's own FastAPI app (serve/app.py) this way, so its routes, errors, streaming, tenant
header, admission and priorities are the single server's, byte for byte. The ingress sends the request over a Ray
handle; what comes back is first `ResponseStart`, then the body's chunks as the app sends them (one per server-sent
event). The app sees a client that disconnects when the consumer stops reading (the ingress's own client left, or
the replica is shutting down): it cancels the engine request, freeing its KV and its slot, as for a direct client.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Sequence, Union

# Headers of the replica's response that describe its own transfer; the ingress's server sets its own.
# How long the app may take to finish after its response ended or its client left (it cancels its engine request).
APP_EXIT_S = 5.0
HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"})


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


def _scope(request: ForwardedRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query.encode(), "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


async def call_app(app, request: ForwardedRequest) -> AsyncIterator[Union[ResponseStart, bytes]]:
    """Run `request` through `app`, yielding its ResponseStart and then its body chunks (see the module docstring).
    An app that fails before it responds raises here; closing the generator early disconnects the app's client."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.put_nowait(message)

    task = asyncio.ensure_future(app(_scope(request), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while True:
            message = await sent.get()
            if message is None:  # the app returned (or raised) without ending its response
                task.result()
                return
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((k.decode("latin-1"), v.decode("latin-1"))
                                                             for k, v in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()  # the response ended, or nobody reads it any more: the app's disconnect watch ends it
        if not task.done():
            try:  # wait_for cancels the app's task if it outlives the timeout, or if this wait is cancelled
                await asyncio.wait_for(task, timeout=APP_EXIT_S)
            except asyncio.TimeoutError:
                pass
            except Exception:  # noqa: BLE001 - the app failed after its response ended; it logged why itself
                pass


def forwarded_headers(headers: Sequence[tuple[str, str]]) -> dict[str, str]:
    """A replica's response headers as the ingress sends them on (hop-by-hop ones left to its own server)."""
    return {k: v for k, v in headers if k.lower() not in HOP_HEADERS}
