"""`ttftc serve MODEL --replicas N`: N replicas of a model behind one OpenAI-compatible endpoint, on Ray Serve.

Modules: routing (which replica serves a request: prefix affinity over a consistent-hash ring, or least loaded; no
Ray), asgi (a replica runs ttftc's own FastAPI app in-process and streams its response back; no Ray), metrics (the
replicas' /metrics merged, each series labelled with its replica; no Ray), deployment (the Ray Serve deployments
and the commands' entry point; the only module that imports Ray, so `ttftc serve` without --replicas never does).
"""
