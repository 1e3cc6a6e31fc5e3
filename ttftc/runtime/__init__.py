"""Serving-side TTFT: prefix KV reuse with tenant isolation, chunked prefill, multi-turn sessions, a step scheduler.

    cache = PrefixCache(budget_bytes=1 << 30)
    engine = PrefillEngine(model, prefix_cache=cache, chunk_size=512)
    first = engine.first_token(ids)                    # .token .logits .kv .cached_tokens

Calls without a tenant share the engine's prefix cache; `tenant="acme"` isolates, `tenant=PRIVATE` shares nothing.
"""

from ttftc._lazy import lazy_exports

# Resolved on first use: importing ttftc.runtime loads neither transformers (kv.py needs it) nor the engine.
_LAZY = {
    "ChunkTable": "ttftc.runtime.chunked", "FirstToken": "ttftc.runtime.chunked", "PrefillJob": "ttftc.runtime.chunked",
    "PrefillEngine": "ttftc.runtime.engine",
    "EndEvent": "ttftc.runtime.engine_loop", "EngineClosedError": "ttftc.runtime.engine_loop",
    "EngineLoop": "ttftc.runtime.engine_loop", "TokenEvent": "ttftc.runtime.engine_loop",
    "KVHandle": "ttftc.runtime.kv", "ModelGeometry": "ttftc.runtime.kv",
    "CacheLease": "ttftc.runtime.prefix_cache", "LeaseReleasedError": "ttftc.runtime.prefix_cache",
    "PrefixCache": "ttftc.runtime.prefix_cache", "PrefixCacheStats": "ttftc.runtime.prefix_cache",
    "PRIVATE": "ttftc.runtime.prefix_cache",
    "GREEDY": "ttftc.runtime.sampling", "Sampling": "ttftc.runtime.sampling",
    "Request": "ttftc.runtime.scheduler", "RequestRecord": "ttftc.runtime.scheduler",
    "StepScheduler": "ttftc.runtime.scheduler", "StepStats": "ttftc.runtime.scheduler",
    "ChatSession": "ttftc.runtime.sessions", "Turn": "ttftc.runtime.sessions",
}

__all__ = [
    "GREEDY", "PRIVATE", "CacheLease", "ChatSession", "ChunkTable", "EndEvent", "EngineClosedError", "EngineLoop", "FirstToken",
    "KVHandle", "LeaseReleasedError", "ModelGeometry",
    "PrefillEngine", "PrefillJob", "PrefixCache", "PrefixCacheStats", "Request", "RequestRecord", "Sampling",
    "StepScheduler", "StepStats", "TokenEvent", "Turn",
]
assert sorted(__all__) == sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
