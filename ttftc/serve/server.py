"""Running the app under uvicorn: in the foreground with signal handling and drain (`run_server`), or on a thread
with a free port (`BackgroundServer`, for tests and for embedding).

Shutdown (Ctrl-C or SIGTERM): the server stops listening and answers 503 on connections still open, the
requests in flight keep streaming for up to `drain_timeout_s`, whatever is left is then cut off (its engine
request cancelled), and the engine thread stops. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Optional

import uvicorn
from fastapi import FastAPI


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server that tells the app it is draining as soon as a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self._app = app

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


def _config(app: FastAPI, host: str, port: int, drain_timeout_s: float, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                          timeout_graceful_shutdown=max(1, int(round(drain_timeout_s))),
                          # keep-alive connections must not hold the drain open once their request is done
                          timeout_keep_alive=5)


def run_server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, drain_timeout_s: float = 30.0,
               log_level: str = "info") -> int:
    """Serve until Ctrl-C or SIGTERM, then drain (see the module docstring) and stop the LLM's engine. Returns
    how many engine requests were still running when the drain timed out."""
    served = app.state.served
    server = _DrainingServer(_config(app, host, port, drain_timeout_s, log_level), app)
    try:
        server.run()  # returns once the HTTP requests in flight finished or were cut off (uvicorn's drain)
    finally:
        served.draining = True
        # Their engine requests are cancelled by now; this stops the engine thread.
        cut_off = served.llm.close(drain_timeout_s=drain_timeout_s)
    return cut_off


class BackgroundServer:
    """The app served on a thread at `url` (127.0.0.1 and a free port by default); a context manager."""

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, drain_timeout_s: float = 5.0,
                 log_level: str = "warning"):
        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self._server = _DrainingServer(_config(app, self.host, self.port, drain_timeout_s, log_level), app)
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
