"""The prefill engine: prompt in, first token + KV out, reusing cached prefix KV and bounding activation memory.

    engine = PrefillEngine(model, prefix_cache=PrefixCache(2 << 30), chunk_size=512)
    first = engine.first_token(ids, tenant="acme")
    rest = engine.generate(first, max_new_tokens=32)            # our decode loop, or:
    out = model.generate(**first.kv.generate_inputs(first.token), max_new_tokens=31)
    first.kv.release()

`model` is a transformers causal LM, plain or compiled (`torch.compile(model, backend=ttftc.backend(...))`). The
engine calls it with `past_key_values` (a DynamicCache), explicit `position_ids` (so learned absolute positions, as
in GPT-2, are right for a suffix) and `logits_to_keep=1`. Batch size is 1: each request is its own forward.

Without a `chunk_size`, the engine uses the chunk size `ttftc autotune MODEL --chunk-sizes ...` stored for this
model, device and runner (autotune/chunking.py), per prompt length; with none stored, or with `autotune=False`,
each prompt runs in one forward.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence, Union

import torch

from ttftc.runtime.chunked import FirstToken, PrefillJob
from ttftc.runtime.kv import KVHandle, ModelGeometry, unwrap_model
from ttftc.runtime.prefix_cache import PrefixCache
from ttftc.runtime.sampling import GREEDY, Sampling

PromptIds = Union[torch.Tensor, Sequence[int]]


class PrefillEngine:
    def __init__(self, model: torch.nn.Module, prefix_cache: Optional[PrefixCache] = None,
                 chunk_size: Optional[int] = None, *, autotune: bool = True, autotune_cache=None):
        if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                       or chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
            raise TypeError(f"prefix_cache must be a ttftc.runtime.PrefixCache, got {type(prefix_cache).__name__}")
        self.model = model
        self.geometry = ModelGeometry.of(model)
        self.device = next(unwrap_model(model).parameters()).device
        self.chunk_size = chunk_size
        # {tuned prompt length: chunk size} from the autotune cache (an AutotuneCache; None: the default one).
        self.tuned_chunk_sizes: dict[int, Optional[int]] = {}
        if chunk_size is None and autotune:
            from ttftc.autotune.chunking import tuned_chunk_sizes

            self.tuned_chunk_sizes = tuned_chunk_sizes(model, autotune_cache)
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            prefix_cache.bind(self.geometry.block_bytes(prefix_cache.block_size), owner=unwrap_model(model))

    # ---- input checks ----------------------------------------------------------------------------------------------

    def validate(self, input_ids: PromptIds, *, already: int = 0) -> list[int]:
        """The prompt as a list of ints, or a clear ValueError. `already` tokens precede it in the KV."""
        if isinstance(input_ids, torch.Tensor):
            if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
                raise ValueError(f"input_ids must be integer token ids, got a {input_ids.dtype} tensor")
            if input_ids.dim() == 2:
                if input_ids.shape[0] != 1:
                    raise ValueError(f"PrefillEngine serves one prompt per call; got a batch of {input_ids.shape[0]}")
                input_ids = input_ids[0]
            elif input_ids.dim() != 1:
                raise ValueError(f"input_ids must be 1-D or [1, length], got shape {tuple(input_ids.shape)}")
            ids = [int(t) for t in input_ids.tolist()]
        else:
            try:
                ids = [int(t) for t in input_ids]
            except (TypeError, ValueError) as e:
                raise ValueError(f"input_ids must be a sequence of integer token ids: {e}") from None
            if any(isinstance(t, (bool, float)) for t in input_ids):
                raise ValueError("input_ids must be integer token ids, not bools or floats")
        if not ids:
            raise ValueError("empty prompt: a prefill needs at least one token")
        vocab = self.geometry.vocab_size
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        limit = self.geometry.max_positions
        total = already + len(ids)
        if limit is not None and total > limit:
            raise ValueError(
                f"{total} tokens exceed the model's maximum of {limit} positions"
                + (f" ({already} already in the KV)" if already else "")
            )
        return ids

    # ---- prefill ---------------------------------------------------------------------------------------------------

    def start(self, input_ids: PromptIds, *, tenant: Hashable = None, sampling: Sampling = GREEDY) -> PrefillJob:
        """A resumable prefill of a new prompt (prefix-cache lookup done, nothing computed yet)."""
        return PrefillJob(self, self.validate(input_ids), tenant=tenant, sampling=sampling)

    def start_extend(self, handle: KVHandle, input_ids: PromptIds, *, sampling: Sampling = GREEDY) -> PrefillJob:
        """A resumable prefill of `input_ids` appended to the KV already in `handle`."""
        if handle.released:
            raise ValueError("cannot extend a released KV handle")
        new = self.validate(input_ids, already=handle.seq_len)
        return PrefillJob(self, handle.token_ids + new, tenant=handle.tenant, sampling=sampling, handle=handle)

    def first_token(self, input_ids: PromptIds, tenant: Hashable = None, sampling: Sampling = GREEDY) -> FirstToken:
        """Prefill `input_ids` (reusing this tenant's cached prefix) and return the first generated token."""
        return self._run(self.start(input_ids, tenant=tenant, sampling=sampling))

    def extend(self, handle: KVHandle, input_ids: PromptIds, sampling: Sampling = GREEDY) -> FirstToken:
        """Prefill `input_ids` after the KV in `handle` (e.g. the next chat turn); returns the next token.

        The handle grows in place; the returned FirstToken's `kv` is the same handle.
        """
        return self._run(self.start_extend(handle, input_ids, sampling=sampling))

    def chunk_size_for(self, n_tokens: int) -> Optional[int]:
        """The chunk size a prefill of `n_tokens` uncached tokens runs with (None: one forward)."""
        if self.chunk_size is not None or not self.tuned_chunk_sizes:
            return self.chunk_size
        from ttftc.autotune.chunking import pick_chunk_size

        return pick_chunk_size(self.tuned_chunk_sizes, n_tokens)

    def _run(self, job: PrefillJob) -> FirstToken:
        try:
            return job.run(self.chunk_size_for(job.remaining))
        except BaseException:
            job.cancel()
            raise

    # ---- decode ----------------------------------------------------------------------------------------------------

    def decode_step(self, handle: KVHandle, token: int, sampling: Sampling = GREEDY,
                    generator: Optional[torch.Generator] = None) -> tuple[int, torch.Tensor]:
        """Feed `token` (the last one produced) and return (next token, its logits)."""
        if handle.released:
            raise ValueError("cannot decode from a released KV handle")
        (token,) = self.validate([token], already=handle.seq_len)
        logits = self._forward([token], handle.cache, handle.seq_len)
        handle.token_ids.append(token)
        return sampling.pick(logits, generator), logits

    def generate(self, first: FirstToken, max_new_tokens: int, sampling: Sampling = GREEDY,
                 eos_token_id: Optional[int] = None) -> list[int]:
        """`max_new_tokens` tokens starting with `first.token`, decoded from its KV handle (which grows)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        generator = sampling.generator()
        tokens = [first.token]
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            token, _ = self.decode_step(first.kv, tokens[-1], sampling, generator)
            tokens.append(token)
        return tokens

    # ---- the model call ------------------------------------------------------------------------------------------------

    def _forward(self, ids: Sequence[int], kv_cache, start: int) -> torch.Tensor:
        """Logits (fp32, 1-D) of the last of `ids`, which sit at positions start.. and are appended to `kv_cache`."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + x.shape[1], device=self.device).unsqueeze(0)
        with torch.no_grad():
            out = self.model(input_ids=x, position_ids=positions, past_key_values=kv_cache, use_cache=True,
                             logits_to_keep=1)
        return out.logits[0, -1].float()
