"""Chunked prefill of one request: the prompt's uncached tokens run chunk by chunk against the growing KV.

Every forward sees at most one chunk of queries, so activations (hidden states, MLP intermediates, the
[chunk x kv_len] attention scores) are bounded by the chunk size, and only the last position's logits are
computed. A `PrefillJob` is resumable: the step scheduler advances it a few tokens per step between other requests'
decode steps; `PrefillEngine.first_token` simply runs it to the end. A cold job's first stretch may instead be
computed by a bucketed model together with other jobs (`PrefillEngine.prefill_together`), which hands each job
its rows of the batch's KV through `absorb`.

How long a chunk is comes from the caller: a fixed size, or a `ChunkTable` of sizes per prompt length (what
`ttftc autotune --chunk-sizes` measures; autotune/chunking.py builds the table, this layer only reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, Optional, Protocol, Sequence

import torch

from ttftc.runtime.kv import KVHandle, block_payload, cache_from_blocks, cache_from_layers, full_kv_layers, reserve
from ttftc.runtime.prefix_cache import CacheLease, PrefixCache
from ttftc.runtime.sampling import Sampling


class JobEngine(Protocol):
    """What a PrefillJob needs of the engine that runs it (runtime/engine.py's PrefillEngine): the model on the KV
    path, the prefix cache, and one forward of tokens appended to a KV cache. Named here, below the engine, so that
    this module does not import the engine that imports it."""

    model: torch.nn.Module
    prefix_cache: Optional[PrefixCache]

    def _forward(self, ids: Sequence[int], kv_cache, start: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class ChunkTable:
    """Chunk sizes per prompt length: {prompt length: chunk size, None for the whole prompt in one forward}.

    A prefill of n uncached tokens takes the entry of the smallest length >= n, else that of the longest length;
    an empty table means one forward.
    """

    sizes: Mapping[int, Optional[int]] = field(default_factory=dict)

    def for_tokens(self, n_tokens: int) -> Optional[int]:
        if not self.sizes:
            return None
        at_least = [length for length in self.sizes if length >= n_tokens]
        return self.sizes[min(at_least) if at_least else max(self.sizes)]


@dataclass
class FirstToken:
    """The result of a prefill: the first generated token, the logits it came from, and the KV to continue from.

    `cached_tokens` prompt tokens were served from KV computed earlier (prefix cache or earlier turns);
    `computed_tokens` went through the model now. The last prompt token is always among the computed ones.
    """

    token: int
    logits: torch.Tensor
    kv: KVHandle
    cached_tokens: int
    computed_tokens: int


class PrefillJob:
    """Prefill state of one request. Create it with `PrefillEngine.start` (new prompt) or `.start_extend`."""

    def __init__(self, engine: JobEngine, token_ids: list[int], *, tenant: Hashable, sampling: Sampling,
                 handle: Optional[KVHandle] = None):
        self.engine = engine
        self.token_ids = token_ids
        self.tenant = tenant
        self.sampling = sampling
        self._match: Optional[CacheLease] = None
        self._handle = handle
        self._logits: Optional[torch.Tensor] = None
        self.result: Optional[FirstToken] = None
        self._unpublished = False
        self.cancelled = False
        if handle is not None:
            # Extending live KV (the next turn of a chat): everything already in the handle counts as cached.
            self._kv = handle.cache
            self.position = handle.seq_len
            reserve(self._kv, len(token_ids))
        else:
            cache = engine.prefix_cache
            if cache is not None:
                # Never serve the last prompt token from cache: its logits are the whole point of the prefill.
                self._match = cache.match(token_ids, tenant=tenant, max_tokens=len(token_ids) - 1)
                blocks = self._match.blocks
            else:
                blocks = ()
            self._kv = cache_from_blocks(engine.model, blocks, capacity=len(token_ids))
            self.position = self._match.num_tokens if self._match is not None else 0
        self.cached_tokens = self.position

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.position

    @property
    def cold(self) -> bool:
        """Nothing of this prompt is in its KV yet (no cache hit, no earlier turn, no chunk run)."""
        return self.position == 0 and self._handle is None and not self.cancelled and self.result is None

    @property
    def done(self) -> bool:
        return self.result is not None

    def advance(self, max_tokens: Optional[int] = None, *, publish: bool = True) -> Optional[FirstToken]:
        """Run ONE forward over the next `max_tokens` uncached tokens (all of them when None).

        Returns the FirstToken once the whole prompt is in the KV, else None. With publish=False the prompt's
        blocks go to the prefix cache only when the caller calls `publish()` (see there).
        """
        if self.cancelled:
            raise RuntimeError("this prefill job was cancelled")
        if self.result is not None:
            return self.result
        n = self.remaining if max_tokens is None else min(int(max_tokens), self.remaining)
        if n < 1:
            raise ValueError(f"a prefill step needs at least one token, got max_tokens={max_tokens}")
        start = self.position
        self._logits = self.engine._forward(self.token_ids[start:start + n], self._kv, start)
        self.position += n
        if self._handle is not None:
            self._handle.token_ids.extend(self.token_ids[start:start + n])
        if self.remaining == 0:
            self.result = self._finish()
            if publish:
                self.publish()
        return self.result

    def absorb(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], logits: torch.Tensor, *,
               publish: bool = True) -> Optional[FirstToken]:
        """Take the KV of this cold job's first `n` tokens, computed elsewhere (a bucketed batch): per layer
        (keys, values) of shape [1, kv_heads, n, head_dim], and the logits at token n-1. Returns the FirstToken when
        that was the whole prompt, else None (the rest continues with `advance`)."""
        if not self.cold:
            raise RuntimeError("only a cold prefill job can take KV computed elsewhere")
        n = layers[0][0].shape[-2]
        if not 1 <= n <= len(self.token_ids):
            raise ValueError(f"absorbed KV covers {n} tokens; the prompt has {len(self.token_ids)}")
        self._kv = cache_from_layers(self.engine.model, layers, capacity=len(self.token_ids))
        self._logits = logits
        self.position = n
        if self.remaining == 0:
            self.result = self._finish()
            if publish:
                self.publish()
        return self.result

    def run(self, chunk_size: Optional[int] = None) -> FirstToken:
        """Advance chunk by chunk to the end."""
        while self.result is None:
            self.advance(chunk_size)
        return self.result

    def cancel(self) -> None:
        """Give up: drop the KV and any lease. The handle of an extend job stays valid up to what was computed."""
        self.cancelled = True
        self._unpublished = False
        if self._match is not None:
            self._match.release_if_held()
        self._kv = None

    def _finish(self) -> FirstToken:
        logits = self._logits
        token = self.sampling.pick(logits, self.sampling.generator())
        handle = self._handle
        if handle is None:
            handle = KVHandle(self._kv, list(self.token_ids), self.tenant)
        self._unpublished = True
        return FirstToken(token=token, logits=logits, kv=handle, cached_tokens=self.cached_tokens,
                          computed_tokens=len(self.token_ids) - self.cached_tokens)

    def publish(self) -> None:
        """Put the prompt's full blocks into the prefix cache, lease them to the KV handle, and let go of the
        blocks this prompt was served from. Split from the prefill so that a server can send the first token
        before this copy (about 64 KiB per token of llama-135m); it must run before the first decode step, which
        grows the KV past the prompt. A no-op before the prefill finished and after the first call."""
        if not self._unpublished:
            return
        self._unpublished = False
        try:
            lease = self._insert()
        finally:
            if self._match is not None:
                self._match.release()
                self._match = None
            self._kv = None
        if lease is not None:
            self.result.kv.replace_lease(lease)

    def _insert(self) -> Optional[CacheLease]:
        cache = self.engine.prefix_cache
        if cache is None:
            return None
        layers = full_kv_layers(self._kv, len(self.token_ids))
        if layers is None:
            return None
        bs = cache.block_size
        return cache.insert(self.token_ids, lambda i: block_payload(layers, i * bs, (i + 1) * bs), tenant=self.tenant)
