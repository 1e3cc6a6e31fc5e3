"""Running the app under uvicorn: in the foreground with signal handling and drain (`run_server`), or on a thread
with a free port (`BackgroundServer`, for tests and for embedding).

Shutdown (Ctrl-C or SIGTERM): the server stops listening and answers 503 on connections still open, the
requests in flight keep streaming for up to `drain_timeout_s`, and whatever is left is then cut off: a stream ends
with an error event and `[DONE]` (a client reads why it ended, not a broken connection), its engine request is
cancelled, and it counts among the requests `run_server` reports cut off. A response its client does not read
cannot end that way; uvicorn drops its connection DRAIN_GRACE_S later. Then the engine thread stops. A second
Ctrl-C exits at once.

`timeouts` (serve/timeouts.py) bound how long a client may take to send a request and stay idle between two.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time
from typing import Optional

import uvicorn
from fastapi import FastAPI

from ttftc.serve.timeouts import GuardedH11Protocol, HTTPTimeouts

# After the drain timeout cut the responses in flight, how long their last bytes get to leave before uvicorn drops
# the connections still open (those whose client stopped reading).
DRAIN_GRACE_S = 5.0


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server that tells the app it is draining as soon as a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout_s: float):
        super().__init__(config)
        self._app = app
        self._drain_timeout_s = drain_timeout_s

    def handle_exit(self, sig, frame) -> None:
        served = getattr(self._app.state, "served", None)
        if served is not None:
            served.draining = True
        super().handle_exit(sig, frame)
        # uvicorn raises the signal again once it has shut down, so the process dies of it before the engine is
        # stopped; ttftc drains the engine too, then exits with status 0.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's drain, with the app cutting off its own responses at the drain timeout (module docstring)
        before uvicorn's timeout, DRAIN_GRACE_S later, cancels what is still running."""
        served = getattr(self._app.state, "served", None)
        cut = None
        if served is not None:
            served.draining = True
            cut = asyncio.get_running_loop().call_later(self._drain_timeout_s, served.cut_off_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            if cut is not None:
                cut.cancel()


def _server(app: FastAPI, host: str, port: int, drain_timeout_s: float, log_level: str,
            timeouts: HTTPTimeouts) -> _DrainingServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            http=functools.partial(GuardedH11Protocol, request_timeout_s=timeouts.request_s),
                            timeout_graceful_shutdown=drain_timeout_s + DRAIN_GRACE_S,
                            timeout_keep_alive=timeouts.keep_alive_s)
    return _DrainingServer(config, app, drain_timeout_s)


def run_server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, drain_timeout_s: float = 30.0,
               log_level: str = "info", timeouts: HTTPTimeouts = HTTPTimeouts()) -> int:
    """Serve until Ctrl-C or SIGTERM, then drain (see the module docstring) and stop the LLM's engine. Returns
    how many requests the drain cut off: responses ended early, and engine requests still running at its end."""
    served = app.state.served
    server = _server(app, host, port, drain_timeout_s, log_level, timeouts)
    try:
        server.run()  # returns once the HTTP requests in flight finished or were cut off
    finally:
        served.draining = True
        # The cut responses' engine requests are cancelled by now; this stops the engine thread.
        engine_cut_off = served.llm.close(drain_timeout_s=drain_timeout_s)
    return served.cut_off + engine_cut_off


class BackgroundServer:
    """The app served on a thread at `url` (127.0.0.1 and a free port by default); a context manager."""

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, drain_timeout_s: float = 5.0,
                 log_level: str = "warning", timeouts: HTTPTimeouts = HTTPTimeouts()):
        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self._server = _server(app, self.host, self.port, drain_timeout_s, log_level, timeouts)
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "BackgroundServer":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="ttftc-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain and stop the HTTP server (the LLM stays up: it belongs to the caller)."""
        self.app.state.served.draining = True
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
