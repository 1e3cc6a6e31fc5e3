"""The compile cache's graphs with symbolic sizes: what `TtftcBackend(graph_cache=...)` loads instead of compiling.

    backend = TtftcBackend(Config(...), graph_cache=DynamicGraphCache(CompileCache(root), model))
    torch.compile(model, backend=backend, dynamic=True)   # a second process loads every graph: backend.graphs_loaded

Dynamo traces in every process; the backend then looks its graph up here, by a key over Dynamo's graph as
capture.describe_dynamo_graph describes it (code, inputs with their symbolic shapes, the guards installed so far),
the model (code, config, weights: the graph's weights are frozen into it), the Config digest and every pass uuid
(measured choices included), the autotune cache's content where tuning is on, ttftc's source, the versions and the
device. A hit skips AOTAutograd, the passes and lowering.

Entries live beside the bucket graphs (entries/<key>.json, constants in blobs/, shared with them by content) and
are read like them: size-limited, confined, decoded by allow-list (dynamic_format.py). A bad entry is reported with
one warning, deleted and compiled again. One traced graph may compile to a few variants, each with the guards its
compile added (a KV length of 0 or not, say): an entry holds up to MAX_VARIANTS, and the backend takes the first whose
guards hold.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import torch

from ttftc.autotune.cache import AutotuneCache
from ttftc.buckets.model_info import vocab_size_of
from ttftc.capture import GraphDescription
from ttftc.cache.atomic import write_json
from ttftc.cache.dynamic_format import encode_dynamic, parse_dynamic
from ttftc.cache.graph_format import MAX_GRAPH_BYTES
from ttftc.cache.keys import combine
from ttftc.cache.schema import as_list, field
from ttftc.cache.store import CompileCache, default_cache
from ttftc.confined import UnsafePathError, read_regular
from ttftc.config import Config
from ttftc.dynamo_backend import CachedGraph
from ttftc.passes.manager import PassManager


# A traced graph compiles to a variant per answer to the size questions its passes asked (2 in the KV path: a KV
# length of 0 or not); more than a few means the entry is not one ttftc wrote, or a pass asks too much.
MAX_VARIANTS = 4
MAX_ENTRY_BYTES = MAX_VARIANTS * MAX_GRAPH_BYTES


class DynamicGraphCache:
    """A graph cache (dynamo_backend.GraphCache) for the graphs `model` compiles to, kept in `cache`."""

    def __init__(self, cache: CompileCache, model: torch.nn.Module):
        self.cache = cache
        self.model = model
        self.vocab_size = vocab_size_of(model)
        self._weights_shared = False

    def key(self, config: Config, description: GraphDescription) -> str:
        device = torch.device(_device_type(description))
        parts = {**self.cache._common(self.model, device), "kind": "dynamic", "graph": description.text,
                 "config": config.digest(), "passes": PassManager(config).uuid()}
        if config.autotune:
            parts["autotune"] = AutotuneCache().content_digest()  # tuned configs can be baked into lowered graphs
        return combine(parts)

    def load(self, config: Config, description: GraphDescription) -> list[CachedGraph]:
        """The variants stored for this graph (none on a miss); a bad entry is discarded whole."""
        cache = self.cache
        path = cache._entry("entries", self.key(config, description))
        if path is None or not os.path.lexists(path):
            cache.misses += 1
            return []
        device = torch.device(_device_type(description))
        self._share_weights(device)
        try:
            variants = as_list(field(json.loads(read_regular(path, limit=MAX_ENTRY_BYTES)), "dynamic", ""), "dynamic",
                               lambda v, w: v)
            if not 1 <= len(variants) <= MAX_VARIANTS:
                raise ValueError(f"an entry holds 1 to {MAX_VARIANTS} variants, this one {len(variants)}")
            graphs = []
            for variant in variants:
                spec = parse_dynamic(variant, lambda key: cache._load_blob(key, device), device.type, description,
                                     self.vocab_size, description.outputs)
                graphs.append(CachedGraph(spec.build(), spec.inputs, spec.guards, spec.dynamic_dims))
        except Exception as exc:  # anything wrong with an entry means: compile it again
            cache._discard(path, exc)
            cache.misses += 1
            return []
        cache.hits += 1
        return graphs

    def _share_weights(self, device: torch.device) -> None:
        """Let a loaded graph's constants that equal one of the model's weights be that weight (as a compiled graph's
        frozen weights are), not a second copy read from a blob: the weights are hashed for the key already."""
        if self._weights_shared:
            return
        self._weights_shared = True
        state = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        for tensor in state.values():
            if tensor.device == device:
                self.cache._blobs.setdefault(self.cache._hash(tensor), tensor.detach())

    def save(self, config: Config, description: GraphDescription, graph: CachedGraph) -> None:
        """Add `graph` to its entry's variants (replacing one with the same guards; the oldest go past MAX_VARIANTS)."""
        cache = self.cache
        path = cache._entry("entries", self.key(config, description))
        try:
            if path is None:
                return
            encoded = encode_dynamic(graph.graph_module, graph.live_inputs, graph.guards, graph.dynamic_dims,
                                     description, cache._store_blob, _device_type(description))
            variants = [v for v in self._stored_variants(path) if v.get("guards") != encoded["guards"]]
            write_json(path, {"dynamic": (variants + [encoded])[-MAX_VARIANTS:]})
        except Exception as exc:  # a graph that cannot be saved still runs; it is just not cached
            warnings.warn(f"ttftc compile cache: a dynamic-shape graph was not cached: {str(exc)[:300]}", stacklevel=3)

    @staticmethod
    def _stored_variants(path) -> list[dict]:
        """The variants already at `path`, unchecked (they are checked when loaded); none if it holds no list."""
        try:
            stored = json.loads(read_regular(path, limit=MAX_ENTRY_BYTES)).get("dynamic")
        except (OSError, ValueError, AttributeError, UnsafePathError):
            return []
        return [v for v in stored if isinstance(v, dict)] if isinstance(stored, list) else []


def _device_type(description: GraphDescription) -> str:
    """The device of the graph's tensor inputs (the first tensor's: a graph's inputs share one device here)."""
    for value in description.values:
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def default_dynamic_cache(model: torch.nn.Module) -> Optional[DynamicGraphCache]:
    """The default compile cache's graph cache for `model`, or None when the compile cache is off."""
    cache = default_cache()
    return DynamicGraphCache(cache, model) if cache is not None else None
