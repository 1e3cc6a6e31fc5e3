"""ttftc's on-disk compile cache: compiled bucket graphs and bucketing plans, shared across processes.

    root/entries/<key>.json       one compiled graph (after passes and lowering), see graph_format.py; or the
                                  variants of one dynamic-shape graph of the KV path (dynamic_graphs.py)
    root/plans/<key>.json         one bucketing plan
    root/blobs/<sha256>.safetensors  one constant tensor, named by the hash of its content

A graph's key hashes the model (code, config, weights: keys.model_fingerprint), the input signature, the
Config digest with every pass uuid (PassManager.uuid), the autotune cache's content (its configs are baked into
the lowered graph), the ttftc source, the versions of ttftc, torch, triton
and transformers, and the device. A hit loads the graph and its constants: nothing is traced, no pass or
lowering runs. Constants are content-addressed, so the buckets of one model share their weights on disk.

Every file is written to a temporary name and renamed (atomic.py), so concurrent writers and readers are
safe. A corrupted, partial or crafted entry is reported with one warning, deleted and rebuilt: the cache directory
is untrusted input like any artifact. Keys must match their hex pattern before they become a path, paths stay
inside the cache directory (confined.py), graphs are decoded by allow-list (graph_format.py), and every file is read
with its kind's size limit. Something that is no regular file at an entry's path (a directory, a FIFO, a symlink)
is a miss with a warning, never an exception out of `ttftc.compile`: a FIFO or a symlink is unlinked like a bad
entry (the link, never its target); a directory is left where it is, and the rebuilt graph is not cached there.
"""

from __future__ import annotations

import json
import os
import re
import stat
import warnings
from pathlib import Path
from typing import Optional

import safetensors.torch
import torch

from ttftc.autotune.cache import AutotuneCache
from ttftc.buckets.model_info import vocab_size_of
from ttftc.buckets.program import GraphProgram, GraphSignature
from ttftc.buckets.plan import BucketPlan
from ttftc.cache.atomic import atomic_path, write_json
from ttftc.confined import UnsafePathError, confined_path, read_regular, regular_file
from ttftc.cache.graph_format import MAX_GRAPH_BYTES, GraphFormatError, decode_program, encode_program
from ttftc.cache.schema import MAX_PLAN_BYTES, SHA256_HEX, as_str, field, plan_from_json
from ttftc.cache.keys import combine, device_description, model_fingerprint, tensor_hash
from ttftc.source_hash import ttftc_source_hash, versions
from ttftc.config import Config
from ttftc.passes.manager import PassManager

CACHE_ENV = "TTFTC_COMPILE_CACHE"  # the compile cache directory itself, or "off"
ROOT_ENV = "TTFTC_CACHE_DIR"  # ttftc's cache root (shared with the autotune cache); compile/ below it
_DISABLED = ("", "0", "off", "none", "false")
_ENTRY_KEY = re.compile(r"[0-9a-f]{32}\Z")  # keys.combine
# A blob holds one constant tensor; the largest is an embedding or LM head, and 16 GiB holds that of a model with a
# 128k vocabulary and 16k hidden size in float32. A larger file is not a blob written here, and is refused unread.
MAX_BLOB_BYTES = 16 << 30


def default_cache_dir() -> Optional[Path]:
    """$TTFTC_COMPILE_CACHE ("off" disables the cache), else $TTFTC_CACHE_DIR/compile, else ~/.cache/ttftc/compile."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in _DISABLED else Path(value).expanduser()
    root = os.environ.get(ROOT_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "ttftc")
    return Path(root) / "compile"


def default_cache() -> Optional["CompileCache"]:
    root = default_cache_dir()
    return CompileCache(root) if root is not None else None


class CompileCache:
    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.hits = 0
        self.misses = 0
        self.corrupt = 0
        self._fingerprints: dict[int, tuple[torch.nn.Module, str]] = {}
        self._hashes: dict[int, tuple[torch.Tensor, str]] = {}
        self._blobs: dict[str, torch.Tensor] = {}

    # -- keys --------------------------------------------------------------------------------------------
    def _fingerprint(self, model: torch.nn.Module) -> str:
        # Hashing the weights is the expensive part of a key; a model is hashed once per cache object.
        held = self._fingerprints.get(id(model))
        if held is None or held[0] is not model:
            held = (model, model_fingerprint(model, self._hash))
            self._fingerprints[id(model)] = held
        return held[1]

    def _common(self, model: torch.nn.Module, device: torch.device) -> dict:
        return {
            "model": self._fingerprint(model),
            "versions": versions(),
            "ttftc_source": ttftc_source_hash(),
            "device": device_description(device),
        }

    def graph_key(self, model, config: Config, signature: GraphSignature, device: torch.device) -> str:
        parts = {**self._common(model, device), "signature": signature.to_dict(),
                 "config": config.digest(), "passes": PassManager(config).uuid()}
        if config.autotune:
            # Lowering bakes tuned configs into the graph, so a retune must not hit graphs built before it.
            parts["autotune"] = AutotuneCache().content_digest()
        return combine(parts)

    def plan_key(self, model, buckets: tuple[int, ...], device: torch.device) -> str:
        return combine({**self._common(model, device), "buckets": list(buckets), "kind": "plan"})

    # -- paths -------------------------------------------------------------------------------------------
    def _path(self, kind: str, key: str, suffix: str, pattern: re.Pattern) -> Path:
        """root/kind/key.suffix, once the key is checked against its pattern and the path stays inside root."""
        if not isinstance(key, str) or not pattern.match(key):
            raise ValueError(f"{kind} key {key!r} is not a {pattern.pattern} hex digest")
        return confined_path(self.root, f"{kind}/{key}{suffix}")

    def _entry(self, kind: str, key: str) -> Optional[Path]:
        """The path of an entry or plan, or None (with a warning) when this cache directory cannot hold it safely."""
        try:
            return self._path(kind, key, ".json", _ENTRY_KEY)
        except UnsafePathError as exc:
            warnings.warn(f"ttftc compile cache: not using {self.root}: {exc}", stacklevel=4)
            return None

    # -- graphs ------------------------------------------------------------------------------------------
    def load_graph(self, model, config: Config, signature: GraphSignature,
                   device: torch.device) -> Optional[GraphProgram]:
        path = self._entry("entries", self.graph_key(model, config, signature, device))
        if path is None or not os.path.lexists(path):
            self.misses += 1
            return None
        try:
            data = json.loads(read_regular(path, limit=MAX_GRAPH_BYTES))
            if as_str(field(data, "signature", ""), "signature") != signature.name:
                raise GraphFormatError(f"the entry holds graph {data['signature']!r}, not {signature.name}")
            program = decode_program(field(data, "program", ""), lambda key: self._load_blob(key, device), device.type,
                                     vocab_size_of(model))
            if program.signature != signature:
                raise GraphFormatError(f"the entry's graph is for {program.signature}, not {signature}")
        except Exception as exc:  # anything wrong with an entry means: rebuild it
            self._discard(path, exc)
            self.misses += 1
            return None
        self.hits += 1
        return program

    def store_graph(self, model, config: Config, program: GraphProgram, device: torch.device) -> None:
        path = self._entry("entries", self.graph_key(model, config, program.signature, device))
        try:
            if path is None:
                return
            encoded = encode_program(program, self._store_blob, device.type)
            write_json(path, {"program": encoded, "signature": program.signature.name})
        except Exception as exc:  # a graph that cannot be saved still runs; it is just not cached
            warnings.warn(f"ttftc compile cache: graph {program.signature.name} not cached: {exc}", stacklevel=3)

    # -- plans -------------------------------------------------------------------------------------------
    def load_plan(self, model, device: torch.device, buckets: tuple[int, ...]) -> Optional[BucketPlan]:
        """The plan stored for this model and bucket table, or None; a plan for another table is discarded."""
        path = self._entry("plans", self.plan_key(model, buckets, device))
        if path is None or not os.path.lexists(path):
            return None
        try:
            plan = plan_from_json(json.loads(read_regular(path, limit=MAX_PLAN_BYTES)), "")
            if plan.buckets != tuple(buckets):
                raise ValueError(f"the stored plan is for buckets {list(plan.buckets)}, not {list(buckets)}")
        except Exception as exc:
            self._discard(path, exc)
            return None
        return plan

    def store_plan(self, model, device: torch.device, buckets: tuple[int, ...], plan: BucketPlan) -> None:
        path = self._entry("plans", self.plan_key(model, buckets, device))
        if path is None:
            return
        try:
            write_json(path, plan.to_dict())
        except OSError as exc:  # a directory at the path, a full disk: the plan still holds, it is just not cached
            warnings.warn(f"ttftc compile cache: plan not cached at {path}: {exc}", stacklevel=3)

    # -- constants ---------------------------------------------------------------------------------------
    def _hash(self, t: torch.Tensor) -> str:
        held = self._hashes.get(id(t))
        if held is None or held[0] is not t:
            held = (t, tensor_hash(t))
            self._hashes[id(t)] = held
        return held[1]

    def _store_blob(self, t: torch.Tensor) -> str:
        key = self._hash(t)
        path = self._path("blobs", key, ".safetensors", SHA256_HEX)
        if not os.path.lexists(path):
            with atomic_path(path) as tmp:
                safetensors.torch.save_file({"t": t.detach().contiguous().cpu()}, str(tmp))
        return key

    def _load_blob(self, key: str, device: torch.device) -> torch.Tensor:
        cached = self._blobs.get(key)
        if cached is not None:
            return cached
        path = self._path("blobs", key, ".safetensors", SHA256_HEX)  # before the key touches the filesystem
        try:
            # Read into memory, never mapped: a map ties the graph to the file, so truncating the blob would kill the
            # next forward (SIGBUS) and rewriting it in place would change a constant after its hash was checked.
            tensor = safetensors.torch.load(read_regular(regular_file(path), limit=MAX_BLOB_BYTES))["t"].to(device)
            if tensor_hash(tensor) != key:
                raise ValueError(f"constant {path.name} does not match its checksum")
        except Exception:
            path.unlink(missing_ok=True)  # a confined blob of this cache: let the rebuild write a good copy
            raise
        self._blobs[key] = tensor
        return tensor

    def _discard(self, path: Path, exc: Exception) -> None:
        """Warn about a bad entry and delete it when it is a file (a symlink is unlinked, never followed); a
        directory or another special file is left alone: the rebuilt entry is then not cached either."""
        self.corrupt += 1
        try:
            removable = not stat.S_ISDIR(os.lstat(path).st_mode)
            if removable:
                path.unlink()
        except OSError:  # gone already, or not ours to delete
            removable = False
        action = "rebuilding it" if removable else "rebuilding the graph without caching it; remove it"
        shown = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"ttftc compile cache: ignoring corrupted entry {path} ({shown[:300]}); {action}", stacklevel=4)

