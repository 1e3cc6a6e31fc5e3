"""KV state of one request: the model's geometry, the block layout the prefix cache stores, and the KV handle.

A cached block is ONE tensor of shape [num_layers, 2 (key, value), kv_heads, block_size, head_dim]: one allocation
per block keeps byte accounting exact (evicting a block frees exactly its bytes; no block is a view that keeps a
bigger tensor alive).

The live KV of a request is a transformers `DynamicCache` (shape [1, kv_heads, seq, head_dim] per layer), so the
handle can be passed straight to `model.generate(..., past_key_values=...)`.

Several requests decode in ONE forward through `RaggedDecodeCache`, which appends each row's new key/value to that
request's own cache and hands attention the rows' KV of different lengths as they are (nothing is padded or
copied), and `ragged_decode_attention`, the attention function (registered with transformers under
RAGGED_ATTENTION) that attends each row's one query to its own KV. The GEMMs of the forward see all rows at once,
which is the point: a decode step reads every weight once, however many requests it serves.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer

from ttftc.runtime.prefix_cache import CacheLease, LeaseReleasedError


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The eager module behind a torch.compile wrapper (which shares its weights)."""
    return getattr(model, "_orig_mod", model)


@dataclass(frozen=True)
class ModelGeometry:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    vocab_size: int
    max_positions: Optional[int]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelGeometry":
        base = unwrap_model(model)
        config = getattr(base, "config", None)
        if config is None:
            raise TypeError(
                f"PrefillEngine needs a transformers causal LM (a module with a .config), got {type(base).__name__}"
            )
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        param = next(base.parameters())
        return cls(
            num_layers=text.num_hidden_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=param.dtype,
            vocab_size=text.vocab_size,
            max_positions=getattr(text, "max_position_embeddings", None),
        )

    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.kv_heads * self.head_dim * itemsize

    def block_bytes(self, block_size: int) -> int:
        return self.bytes_per_token() * block_size


class GrowableLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are a prefix view of a buffer with spare capacity.

    DynamicLayer appends by concatenating the whole past again, so a prompt prefilled in C-token chunks copies
    O(L^2 / C) KV bytes, and a warm prefix is copied once more by the first suffix chunk. Here an append is one
    in-place write into the buffer, past the end of every view handed out so far (what a caller holds is never
    overwritten).

    The state is the buffers and their lengths, plain ints, so that Dynamo traces `update` into the model's graph:
    a length becomes a symbolic size, and the append an in-place write into a graph input, which AOTAutograd
    functionalizes and ttftc's kv_inplace pass writes back in place. `keys`/`values` are properties (views of the
    buffers); assigning them (crop, beam reorder, batch select, offload) adopts the assigned tensor, which the
    next append copies into a fresh buffer. Keys and values keep a length each, because transformers assigns them
    one after the other, each computed from what the other still was.

    Growing inside a compiled forward is correct but copies the past in the graph; `reserve` grows ahead of the
    forward, outside it. A buffer always keeps one slot spare: a view that fills its buffer is contiguous and one
    that does not is not, and a compiled graph specializes on that, so a prefill's last chunk, which would fill a
    buffer sized to the prompt, would need a graph of its own.
    """

    def __init__(self, capacity: int = 0, **kwargs):
        self._key_buffer: Optional[torch.Tensor] = None
        self._value_buffer: Optional[torch.Tensor] = None
        self._length = self._value_length = 0
        super().__init__(**kwargs)
        self.capacity_hint = capacity

    @property
    def keys(self) -> Optional[torch.Tensor]:
        kb = self._key_buffer
        return None if kb is None else kb[:, :, :self._length]

    @keys.setter
    def keys(self, tensor: Optional[torch.Tensor]) -> None:
        self._key_buffer, self._length = _adopted(tensor)

    @property
    def values(self) -> Optional[torch.Tensor]:
        vb = self._value_buffer
        return None if vb is None else vb[:, :, :self._value_length]

    @values.setter
    def values(self, tensor: Optional[torch.Tensor]) -> None:
        self._value_buffer, self._value_length = _adopted(tensor)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._key_buffer = self._value_buffer = None
        self._length = self._value_length = 0
        self.is_initialized = True

    def allocate(self, capacity: int, batch: int, heads: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """Empty buffers for `capacity` tokens, before the first append (a forward then only writes into them)."""
        self.device = device
        self._key_buffer = torch.empty((batch, heads, capacity + 1, head_dim), dtype=dtype, device=device)
        self._value_buffer = torch.empty((batch, heads, capacity + 1, value_dim), dtype=dtype, device=device)
        self._length = self._value_length = 0
        self.is_initialized = True

    def _fits(self, key_states: torch.Tensor, value_states: torch.Tensor, new: int) -> bool:
        kb, vb = self._key_buffer, self._value_buffer
        if kb is None or vb is None or self._value_length != self._length:
            return False
        if not torch.compiler.is_compiling() and kb.is_inference() and not torch.is_inference_mode_enabled():
            return False  # an inference tensor cannot be written in place outside inference mode
        # A buffer of another dtype would silently convert what copy_ writes; another geometry would not fit.
        return (new < kb.shape[-2] and new < vb.shape[-2] and kb.dtype == key_states.dtype
                and vb.dtype == value_states.dtype and kb.shape[:2] == key_states.shape[:2]
                and vb.shape[:2] == value_states.shape[:2] and kb.shape[-1] == key_states.shape[-1]
                and vb.shape[-1] == value_states.shape[-1] and kb.device == key_states.device)

    def _reallocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        old = self._length
        kb = key_states.new_empty((*key_states.shape[:2], capacity + 1, key_states.shape[-1]))
        vb = value_states.new_empty((*value_states.shape[:2], capacity + 1, value_states.shape[-1]))
        if self._key_buffer is not None and old:
            kb[:, :, :old].copy_(self._key_buffer[:, :, :old])
            vb[:, :, :old].copy_(self._value_buffer[:, :, :old])
        self._key_buffer, self._value_buffer = kb, vb

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self._length
        new = old + key_states.shape[-2]
        if not self._fits(key_states, value_states, new):
            # Grow geometrically (decode appends one token at a time) but never below the requested capacity.
            self._reallocate(key_states, value_states, max(new, self.capacity_hint, old + old // 4 + 64))
        # narrow, not [:, :, a:b]: one slice of the buffer itself, the form the kv_inplace pass proves in place,
        # where indexing adds full slices of the other dimensions whenever their sizes are symbolic.
        self._key_buffer.narrow(2, old, new - old).copy_(key_states)
        self._value_buffer.narrow(2, old, new - old).copy_(value_states)
        self._length = self._value_length = new
        return self._key_buffer.narrow(2, 0, new), self._value_buffer.narrow(2, 0, new)

    def reserve(self, total_tokens: int) -> None:
        """Room for `total_tokens` in all, grown now (outside any compiled forward) if the buffers are smaller."""
        self.capacity_hint = max(self.capacity_hint, total_tokens)
        kb, vb = self._key_buffer, self._value_buffer
        if kb is None or vb is None or total_tokens < min(kb.shape[-2], vb.shape[-2]):
            return
        old = self._length
        self._reallocate(kb[:, :, :0], vb[:, :, :0], max(total_tokens, old + old // 4 + 64))

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        if hasattr(self, "cumulative_length"):
            self.cumulative_length = 0


def _adopted(tensor: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], int]:
    """(buffer, length) for a tensor assigned to a GrowableLayer's keys or values."""
    if tensor is None or tensor.dim() != 4:
        return None, 0  # None (reset), or the empty placeholder of transformers' lazy_initialization
    return tensor, tensor.shape[-2]


def new_cache(model: torch.nn.Module, capacity: int = 0):
    """An empty DynamicCache for `model`, with room for `capacity` tokens in its full-attention layers (allocated
    now, from the model's geometry, so that the first forward only writes into them)."""
    # With the config, sliding-window models get their sliding layers, exactly as in the model's own forward.
    # Compiled models get the same layers: their graphs keep each append as an in-place write (see GrowableLayer).
    cache = DynamicCache(config=unwrap_model(model).config)
    if cache.layers:
        cache.layers = [GrowableLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
        if capacity > 0:
            geometry = ModelGeometry.of(model)
            device = next(unwrap_model(model).parameters()).device
            for layer in cache.layers:
                if isinstance(layer, GrowableLayer):
                    # A layer whose KV turns out to have another geometry or dtype reallocates on its first append.
                    layer.allocate(capacity, 1, geometry.kv_heads, geometry.head_dim, geometry.head_dim,
                                   geometry.dtype, device)
    else:
        cache.layer_class_to_replicate = lambda: GrowableLayer(capacity)
    return cache


def reserve(cache, total_tokens: int) -> None:
    """Room for `total_tokens` in the full-attention layers, made now: call it before a forward, so that a compiled
    forward never grows a buffer (a copy of the whole past inside the graph)."""
    for layer in cache.layers:
        if isinstance(layer, GrowableLayer):
            layer.reserve(total_tokens)


def cache_from_blocks(model: torch.nn.Module, blocks: Sequence[torch.Tensor], capacity: int = 0):
    """A DynamicCache holding the KV of `blocks` (possibly none), with room for `capacity` tokens in all."""
    if not blocks:
        return new_cache(model, capacity)
    parts = [[(b[layer, 0], b[layer, 1]) for b in blocks] for layer in range(blocks[0].shape[0])]
    return _filled_cache(model, parts, capacity)


def cache_from_layers(model: torch.nn.Module, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], capacity: int = 0):
    """A DynamicCache holding per-layer (keys, values) of shape [1, kv_heads, n, head_dim] (copied, so the caller's
    tensors, e.g. rows of a batch, are not kept alive), with room for `capacity` tokens in all."""
    dtype = ModelGeometry.of(model).dtype
    return _filled_cache(model, [[(k[0].to(dtype), v[0].to(dtype))] for k, v in layers], capacity)


def _filled_cache(model: torch.nn.Module, parts: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
                  capacity: int):
    """A DynamicCache whose layer i holds the concatenation of parts[i], a list of (keys, values) pieces of shape
    [kv_heads, n, head_dim] in sequence order."""
    cache = new_cache(model, capacity)
    num_layers = len(parts)
    if len(cache.layers) not in (0, num_layers):
        raise ValueError(f"the KV has {num_layers} layers, the model's cache has {len(cache.layers)}")
    cached = sum(k.shape[1] for k, _ in parts[0])
    for layer_idx, pieces in enumerate(parts):
        layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
        if isinstance(layer, GrowableLayer):
            # Copy each piece straight into the layer's buffer: one copy, no intermediate concatenation.
            heads, _, head_dim = pieces[0][0].shape
            keys = pieces[0][0].new_empty((1, heads, max(capacity, cached) + 1, head_dim))  # + the spare slot
            values = torch.empty_like(keys)
            pos = 0
            for k, v in pieces:
                n = k.shape[1]
                keys[0, :, pos:pos + n].copy_(k)
                values[0, :, pos:pos + n].copy_(v)
                pos += n
            layer.lazy_initialization(keys, values)
            layer._key_buffer, layer._value_buffer = keys, values
            layer._length = layer._value_length = cached
        else:
            keys = torch.cat([k for k, _ in pieces], dim=1).unsqueeze(0).contiguous()
            values = torch.cat([v for _, v in pieces], dim=1).unsqueeze(0).contiguous()
            if layer is not None and type(layer) is DynamicLayer:
                # Adopt the fresh tensors: `update` would concatenate them once more onto an empty tensor.
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            else:
                cache.update(keys, values, layer_idx)
    return cache


def full_kv_layers(cache, seq_len: int) -> Optional[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per-layer (keys, values) covering all `seq_len` tokens, or None when some layer keeps less (a sliding
    window that already dropped old tokens): such KV cannot be cached as a prefix."""
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[-2] != seq_len:
            return None
        out.append((keys, values))
    return out or None


def block_payload(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int, stop: int) -> torch.Tensor:
    """A fresh [num_layers, 2, kv_heads, stop-start, head_dim] copy (never a view of the live cache)."""
    return torch.stack([torch.stack((k[0, :, start:stop], v[0, :, start:stop])) for k, v in layers])


RAGGED_ATTENTION = "ttftc_ragged_decode"


class RaggedDecodeCache:
    """The caches of B requests decoding together, as the one cache object a transformers forward takes.

    `update` (called by every attention layer with the batch's new keys/values, [B, kv_heads, 1, head_dim]) appends
    row i to request i's own cache and returns the rows' full KV as lists, which only `ragged_decode_attention`
    reads. `snapshot()`/`restore()` undo a forward that failed halfway (some layers appended, some not): every cache
    layer only ever reassigns its attributes (a GrowableLayer writes past the end of the view it had), so the
    attributes as they were are the KV as it was.
    """

    def __init__(self, caches: Sequence):
        self.caches = list(caches)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if key_states.shape[0] != len(self.caches) or key_states.shape[-2] != 1:
            raise ValueError(f"a ragged decode appends one token to each of {len(self.caches)} rows, got keys of "
                             f"shape {tuple(key_states.shape)}")
        keys, values = [], []
        for row, cache in enumerate(self.caches):
            k, v = cache.update(key_states[row:row + 1], value_states[row:row + 1], layer_idx)
            keys.append(k)
            values.append(v)
        return keys, values

    def snapshot(self) -> list:
        return [(len(cache.layers), [dict(vars(layer)) for layer in cache.layers]) for cache in self.caches]

    def restore(self, snapshot: list) -> None:
        for cache, (num_layers, states) in zip(self.caches, snapshot):
            del cache.layers[num_layers:]
            for layer, state in zip(cache.layers, states):
                vars(layer).clear()
                vars(layer).update(state)


class RaggedDecodeUnsupported(Exception):
    """The model uses an attention feature ragged_decode_attention does not compute; the engine then decodes each
    request in a forward of its own (a capability refusal, not a failure of the forward)."""


def ragged_decode_attention(module, query: torch.Tensor, key, value, attention_mask, scaling=None, dropout=0.0,
                            **kwargs):
    """Attention of a one-token decode for rows whose KV differ in length: `key`/`value` are lists of per-row
    [1, kv_heads, n_i, head_dim] tensors from RaggedDecodeCache (the whole KV a row may see: a sliding-window layer
    already keeps only its window). Returns [B, 1, heads, head_dim], as transformers' attention functions do.

    Features it does not implement raise RaggedDecodeUnsupported, so the engine falls back to one forward per
    request instead of computing something else: logit soft-capping, attention sinks, dropout, more than one query
    per row.
    """
    if not isinstance(key, (list, tuple)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{RAGGED_ATTENTION} takes the per-row KV lists of a RaggedDecodeCache")
    unsupported = [name for name in ("softcap", "s_aux", "sinks") if kwargs.get(name) is not None]
    if dropout or unsupported or query.shape[2] != 1 or len(key) != query.shape[0]:
        raise RaggedDecodeUnsupported(
            f"ragged decode attention covers one query per row without dropout, soft-capping or sinks "
            f"(got {query.shape[2]} queries, dropout {dropout}, {unsupported or 'no extras'})")
    rows = []
    for row, (k, v) in enumerate(zip(key, value)):
        q = query[row:row + 1]
        rows.append(F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), scale=scaling,
                                                   enable_gqa=q.shape[1] != k.shape[1]))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


AttentionInterface.register(RAGGED_ATTENTION, ragged_decode_attention)


class KVHandle:
    """The KV of one request: `token_ids` are the tokens whose keys/values are in `cache`.

    The handle may hold a prefix-cache lease on the prompt's blocks; `release()` (or leaving a `with` block) drops
    it and the KV. A second `release()` raises LeaseReleasedError. A handle that is garbage-collected unreleased
    gives its lease back, so a forgotten handle cannot pin cache blocks forever.

    Continue decoding either with `PrefillEngine.decode_step` / `generate`, or with transformers:
        out = model.generate(**handle.generate_inputs(first.token), max_new_tokens=n)
    which mutates `cache`; a handle supports one continuation.
    """

    def __init__(self, cache, token_ids: list[int], tenant: Hashable, lease: Optional[CacheLease] = None):
        self.cache = cache
        self.token_ids = token_ids
        self.tenant = tenant
        self._lease = lease
        self._released = False
        self._finalizer = weakref.finalize(self, CacheLease.release_if_held, lease) if lease is not None else None

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)

    @property
    def released(self) -> bool:
        return self._released

    @property
    def lease(self) -> Optional[CacheLease]:
        return self._lease

    def replace_lease(self, lease: Optional[CacheLease]) -> None:
        """Hold `lease` instead of the current one (a longer chain after the KV grew)."""
        self._check_live()
        old, old_finalizer = self._lease, self._finalizer
        self._lease = lease
        self._finalizer = weakref.finalize(self, CacheLease.release_if_held, lease) if lease is not None else None
        if old_finalizer is not None:
            old_finalizer.detach()
        if old is not None:
            old.release_if_held()

    def _check_live(self) -> None:
        if self._released:
            raise LeaseReleasedError("this KV handle was released")

    def release(self) -> None:
        if self._released:
            raise LeaseReleasedError("this KV handle was already released")
        self._released = True
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._lease is not None:
            self._lease.release()
        self.cache = None

    def generate_inputs(self, next_token: int) -> dict:
        """kwargs for `model.generate` that continue after `next_token` (the token just produced)."""
        self._check_live()
        ids = torch.tensor([self.token_ids + [int(next_token)]], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "past_key_values": self.cache}

    def __enter__(self) -> "KVHandle":
        return self

    def __exit__(self, *exc) -> None:
        if not self._released:
            self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"{self.seq_len} tokens"
        return f"KVHandle({state}, tenant={self.tenant!r})"
