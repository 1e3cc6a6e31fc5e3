"""How long a client may take to send a request, and to come back with the next one.

uvicorn closes a connection left idle after a response (`timeout_keep_alive`), and h11 bounds how much of an
unfinished request head it buffers (16 KiB), but nothing bounds how long either waits: a connection that never
finishes its request line, its headers or its body holds a socket, and the request's task, for ever (slowloris).
`GuardedH11Protocol` adds that bound. From the moment a connection opens, and from the first byte of each later
request on it, the client has `request_s` to send the whole request (line, headers and body); a connection that
misses it is closed, without a response (like a client that hung up: the app, if it was reading the body, sees a
disconnect). What it covers: a request never finished, or finished too slowly; a connection opened and left
silent; a body still trickling in after an early response (a 413). What it does not: the time the server takes to
answer, a stream being sent (a complete request is never timed out), and a client that reads a response slowly
(the drain timeout bounds that at shutdown). An oversized request is refused by size elsewhere (app.py, 413).

The server speaks HTTP/1.1 through h11 (uvicorn's pure-Python protocol) whatever else is installed, since the
guard is built on it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HTTPTimeouts:
    """`request_s`: from a connection's opening (or a later request's first byte) to the request's last byte.
    `keep_alive_s`: how long a connection may stay idle between requests (uvicorn's `timeout_keep_alive`)."""

    request_s: float = 30.0
    keep_alive_s: float = 5.0

    def __post_init__(self):
        for name in ("request_s", "keep_alive_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the request deadline of the module docstring."""

    def __init__(self, *args, request_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self._request_timeout_s = request_timeout_s
        self._deadline: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection opened and left silent is an unfinished request too

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self._between_requests():
            self._arm()  # the first byte of the next request
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE):  # the whole request arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A request pipelined behind the one just answered starts from uvicorn's buffer, not from data_received: its
        # body may still be trickling in, and its deadline starts now.
        if (self._deadline is None and not self._between_requests()
                and self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE)):
            self._arm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self._request_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        state = self.conn.their_state
        # SEND_BODY: a body still coming; IDLE between requests: a head still coming (or none at all). IDLE during a
        # response cannot happen; DONE and later: the request is whole, and what follows is the server's time.
        unfinished = state is h11.SEND_BODY or (state is h11.IDLE and self._between_requests())
        if unfinished and not self.transport.is_closing():
            log.info("closing a connection from %s: its request did not arrive whole within %g s",
                     self.client, self._request_timeout_s)
            self.transport.close()
