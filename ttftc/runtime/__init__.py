"""Serving-side TTFT: prefix KV reuse with tenant isolation, chunked prefill, multi-turn sessions, a step scheduler.

    cache = PrefixCache(budget_bytes=1 << 30)
    engine = PrefillEngine(model, prefix_cache=cache, chunk_size=512)
    first = engine.first_token(ids, tenant="acme")     # .token .logits .kv .cached_tokens
"""

from ttftc.runtime.chunked import ChunkTable, FirstToken, PrefillJob
from ttftc.runtime.engine import PrefillEngine
from ttftc.runtime.engine_loop import EndEvent, EngineClosedError, EngineLoop, TokenEvent
from ttftc.runtime.kv import KVHandle, ModelGeometry
from ttftc.runtime.prefix_cache import CacheLease, LeaseReleasedError, PrefixCache, PrefixCacheStats
from ttftc.runtime.sampling import GREEDY, Sampling
from ttftc.runtime.scheduler import Request, RequestRecord, StepScheduler, StepStats
from ttftc.runtime.sessions import ChatSession, Turn

__all__ = [
    "GREEDY", "CacheLease", "ChatSession", "ChunkTable", "EndEvent", "EngineClosedError", "EngineLoop", "FirstToken",
    "KVHandle", "LeaseReleasedError", "ModelGeometry",
    "PrefillEngine", "PrefillJob", "PrefixCache", "PrefixCacheStats", "Request", "RequestRecord", "Sampling",
    "StepScheduler", "StepStats", "TokenEvent", "Turn",
]
