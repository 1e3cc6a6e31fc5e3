"""`ttftc serve`: an OpenAI-compatible HTTP server (FastAPI, uvicorn, server-sent events, Prometheus metrics) on a
`ttftc.LLM`. The client that measures it the way operators do, `ttftc loadtest`, is a tool: ttftc/bench/loadtest.py.

    from ttftc.serve import create_app, BackgroundServer
    with BackgroundServer(create_app(llm)) as server:      # a free 127.0.0.1 port; server.url
        ...

Modules: errors (OpenAI's error shape), protocol (request bodies to typed requests), sse (chunks and events),
metrics (Prometheus), policy (tenant priorities, TTFT-SLO admission), warm (pre-warmed, pinned prompts), app (the
endpoints), server (uvicorn, signals and drain), timeouts (how long a client may take to send a request).
"""

from ttftc.serve.app import create_app
from ttftc.serve.policy import ServingPolicy
from ttftc.serve.server import BackgroundServer, run_server
from ttftc.serve.warm import WarmPrompt, WarmPromptsError, read_warm_prompts

__all__ = ["BackgroundServer", "ServingPolicy", "WarmPrompt", "WarmPromptsError", "create_app", "read_warm_prompts",
           "run_server"]
