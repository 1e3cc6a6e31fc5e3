"""`ttftc serve`: an OpenAI-compatible HTTP server (FastAPI, uvicorn, server-sent events, Prometheus metrics) on a
`ttftc.LLM`, and `ttftc loadtest`, a client that measures it the way operators do.

    from ttftc.serve import create_app, BackgroundServer
    with BackgroundServer(create_app(llm)) as server:      # a free 127.0.0.1 port; server.url
        ...

Modules: errors (OpenAI's error shape), protocol (request bodies to typed requests), sse (chunks and events),
metrics (Prometheus), app (the endpoints), server (uvicorn, signals and drain), loadtest and loadtest_report.
"""

from ttftc.serve.app import create_app
from ttftc.serve.server import BackgroundServer, run_server

__all__ = ["BackgroundServer", "create_app", "run_server"]
