"""What a compiled graph depends on, as hashes: the cache key and the artifact manifest are built from these.

The compile cache is keyed by the *source* of the graph (model code, model config, weights, input signature)
rather than by the traced graph itself: hashing the traced graph needs a Dynamo trace, and the trace is most
of the compile time the cache exists to save. Everything that decides what Dynamo would capture is in the
key instead, including the source of every module class the model is built from (as vLLM hashes the files
Dynamo traced) and the versions of torch and transformers that turn that code into a graph.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import torch

_CHUNK_ELEMENTS = 1 << 24


def device_description(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def tensor_hash(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and values (its bytes in contiguous order)."""
    digest = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        chunk = flat[start:start + _CHUNK_ELEMENTS].contiguous().cpu()
        digest.update(chunk.view(torch.uint8).numpy().tobytes() if chunk.numel() else b"")
    return digest.hexdigest()


def _source_files(model: torch.nn.Module) -> list[str]:
    files = set()
    for module in model.modules():
        try:
            files.add(inspect.getsourcefile(type(module)))
        except TypeError:  # built-in classes have no source file
            continue
    return sorted(f for f in files if f)


def model_fingerprint(model: torch.nn.Module, hash_tensor=tensor_hash) -> str:
    """Everything about a model that decides its captured graph: code, config, weights and mode. `hash_tensor` is
    tensor_hash, or a memo of it (the compile cache keeps one, so weights hashed here are not hashed again)."""
    digest = hashlib.sha256()
    for path in _source_files(model):
        digest.update(Path(path).name.encode())
        digest.update(Path(path).read_bytes())
    digest.update(f"{type(model).__module__}.{type(model).__qualname__}|training={model.training}".encode())
    config = getattr(model, "config", None)
    if config is not None:
        as_dict = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        as_dict = {**as_dict, "_attn_implementation": getattr(config, "_attn_implementation", None)}
        digest.update(json.dumps(as_dict, sort_keys=True, default=str).encode())
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    seen: dict[tuple, str] = {}
    for name in sorted(state):
        t = state[name]
        identity = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if identity not in seen:  # tied weights are hashed once
            seen[identity] = hash_tensor(t)
        digest.update(f"{name}|{tuple(t.stride())}|{seen[identity]}".encode())
    return digest.hexdigest()[:32]


def combine(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
