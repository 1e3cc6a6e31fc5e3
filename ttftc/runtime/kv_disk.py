"""The prefix cache's disk tier: KV blocks evicted from RAM, kept in a directory, found again after a restart.

A block on disk is addressed by a digest chain, never by its tokens: the root is sha256 over the model's key and the
namespace (the tenant, or the cache's shared default), and each block's digest is sha256 over its parent's digest
and its own token ids. Two tenants, or two models, therefore never address the same file, and a file name tells
nothing about the prompt.

Every file in the directory is untrusted input, exactly like an artifact: it is read as a capped regular file (no
symlinks), parsed as safetensors (data only), and accepted only when its metadata names this format, its own
digest and this model's key, and it holds exactly one tensor `kv` of the block's dtype and shape whose sha256
matches the one recorded. Anything else is refused with a warning, deleted and counted; nothing read here becomes
code, and nothing outside the directory is touched (names are 64 hex digits plus ".safetensors", built here).
Files are written to a temporary name and renamed, so a reader never sees half a block; a crash can leave at most a
stale temporary file, which the next start removes.

The tier is bounded by `budget_bytes`: storing past it deletes the least recently used blocks (by the time they
were written or last loaded). Whether a hit is loaded or recomputed is the prefix cache's decision
(PrefixCache.match): it loads while the measured load time of the blocks is below the measured recompute time
of their tokens. `load_seconds_per_byte` is measured on every load here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ttftc.cache.atomic import atomic_path
from ttftc.confined import UnsafePathError, read_regular

FORMAT = "ttftc-kv-block-1"
_NAME = re.compile(r"^([0-9a-f]{64})\.safetensors$")
_TMP = re.compile(r"^\.[0-9a-f]{64}\.safetensors\..*\.tmp$")
# The safetensors header of one block is a few hundred bytes; more than this is not a block written here.
_HEADER_ALLOWANCE = 1 << 16
# Until a load has been timed, a read is assumed to cost this much per byte (about 1 GB/s, a cold SSD read): an
# assumption only for the very first decision, replaced by the first measurement.
_PRIOR_SECONDS_PER_BYTE = 1e-9
_EMA = 0.3  # weight of the latest load in the running measurement


def model_key(model: torch.nn.Module, *settings: str) -> str:
    """A digest of the model's weights (names, dtypes, shapes, bytes) and of `settings` that change its KV (the
    precision it computes in, ttftc's version): blocks written under another key are never found."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}\0{data.dtype}\0{tuple(data.shape)}\0".encode())
        digest.update(data.view(-1).view(torch.uint8).numpy().data if data.numel() else b"")
    for setting in settings:
        digest.update(b"\0" + setting.encode())
    return digest.hexdigest()


class DiskTierError(ValueError):
    """A disk tier the user configured cannot be used as given (a path that is not a directory, a bad budget)."""


def root_digest(model_key: str, namespace: str) -> bytes:
    """The chain's root: the model and the namespace, so that neither shares files with another."""
    return hashlib.sha256(b"ttftc-kv\0" + model_key.encode() + b"\0" + namespace.encode()).digest()


def child_digest(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The digest of the block with `tokens` below the block (or root) whose digest is `parent`."""
    return hashlib.sha256(parent + b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)).digest()


@dataclass(frozen=True)
class DiskTierStats:
    blocks: int
    bytes: int
    budget_bytes: int
    stored: int
    loaded: int
    refused: int  # files that failed validation and were deleted
    evicted: int  # blocks deleted to stay within the budget
    load_seconds_per_byte: Optional[float]  # the running measurement; None before the first load


class KVDiskTier:
    """A bounded directory of KV blocks of one model; thread-safe.

    `model_key` names the weights whose KV the blocks hold (a digest of them: two models never share a block);
    `dtype` and `block_shape` are one block's, exactly as the prefix cache holds it.
    """

    def __init__(self, directory: str | os.PathLike, budget_bytes: int, *, model_key: str, dtype: torch.dtype,
                 block_shape: tuple[int, ...]):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise DiskTierError(f"the disk tier's byte budget must be a positive integer, got {budget_bytes!r}")
        if not isinstance(model_key, str) or not model_key:
            raise DiskTierError("the disk tier needs a non-empty model_key naming the model whose KV it keeps")
        if not isinstance(dtype, torch.dtype) or not block_shape or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in block_shape):
            raise DiskTierError(f"a block needs a torch dtype and a shape of positive ints, got {dtype!r}, "
                                f"{block_shape!r}")
        self.dtype = dtype
        self.block_shape = tuple(block_shape)
        self.block_bytes = torch.Size(self.block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise DiskTierError(f"{self.directory} is not a directory; give --kv-disk a directory (it is created)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.model_key = model_key
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}  # hex digest -> file size
        self._bytes = 0  # sum of _sizes
        self._used: dict[str, float] = {}  # hex digest -> last write or load (monotonic order via a counter)
        self._clock = 0
        self._stored = self._loaded = self._refused = self._evicted = 0
        self._seconds_per_byte: Optional[float] = None
        self._scan()

    # ---- the directory ------------------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the blocks a previous process left (oldest first by mtime); remove its stale temporary files."""
        found = []
        for entry in os.scandir(self.directory):
            if _TMP.match(entry.name) and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                continue
            match = _NAME.match(entry.name)
            if match and entry.is_file(follow_symlinks=False):
                info = entry.stat(follow_symlinks=False)
                found.append((info.st_mtime, match.group(1), info.st_size))
        for _, digest, size in sorted(found):
            self._sizes[digest] = size
            self._bytes += size
            self._touch(digest)
        with self._lock:
            self._fit(0)

    def _path(self, digest: str) -> Path:
        return self.directory / f"{digest}.safetensors"

    def _touch(self, digest: str) -> None:
        self._clock += 1
        self._used[digest] = self._clock

    def _forget(self, digest: str) -> None:
        self._bytes -= self._sizes.pop(digest, 0)
        self._used.pop(digest, None)
        try:
            os.unlink(self._path(digest))
        except FileNotFoundError:
            pass

    def _fit(self, incoming: int) -> bool:
        """Delete least recently used blocks until `incoming` more bytes fit; False if they never can."""
        if incoming > self.budget_bytes:
            return False
        while self._sizes and self._bytes + incoming > self.budget_bytes:
            oldest = min(self._used, key=self._used.get)
            self._forget(oldest)
            self._evicted += 1
        return True

    # ---- blocks -------------------------------------------------------------------------------------------------

    def contains(self, digest: bytes) -> bool:
        with self._lock:
            return digest.hex() in self._sizes

    def store(self, digest: bytes, payload: torch.Tensor) -> bool:
        """Write one block (a no-op if it is there already); False when it cannot fit the budget."""
        if payload.dtype != self.dtype or tuple(payload.shape) != self.block_shape:
            raise ValueError(f"a {payload.dtype} {tuple(payload.shape)} block; this tier holds {self.dtype} "
                             f"{self.block_shape}")
        name = digest.hex()
        data = payload.detach().to("cpu").contiguous()
        metadata = {"format": FORMAT, "digest": name, "model_key": self.model_key,
                    "sha256": hashlib.sha256(_tensor_bytes(data)).hexdigest()}
        blob = save_safetensors({"kv": data}, metadata=metadata)
        with self._lock:
            if name in self._sizes:
                self._touch(name)
                return True
            if not self._fit(len(blob)):
                return False
            with atomic_path(self._path(name)) as tmp:
                tmp.write_bytes(blob)
            self._sizes[name] = len(blob)
            self._bytes += len(blob)
            self._touch(name)
            self._stored += 1
            return True

    def load(self, digest: bytes) -> Optional[torch.Tensor]:
        """The block of `digest` when its file is there and valid for this model, dtype and shape; else None (an
        invalid file is deleted, with a warning naming why)."""
        name = digest.hex()
        with self._lock:
            if name not in self._sizes:
                return None
            start = time.perf_counter()
            try:
                blob = read_regular(self._path(name), limit=self.block_bytes + _HEADER_ALLOWANCE)
                tensor = self._validated(name, blob)
            except FileNotFoundError:
                self._forget(name)  # removed behind our back: a miss, nothing to refuse
                return None
            except (UnsafePathError, _Invalid) as exc:
                self._forget(name)
                self._refused += 1
                warnings.warn(f"ttftc KV disk tier: refused {self._path(name)}: {exc}; deleted it", stacklevel=2)
                return None
            self._measure(time.perf_counter() - start, len(blob))
            self._touch(name)
            self._loaded += 1
            return tensor

    def _validated(self, name: str, blob: bytes) -> torch.Tensor:
        try:
            header_len = int.from_bytes(blob[:8], "little")
            header = json.loads(blob[8:8 + header_len]) if 0 < header_len <= _HEADER_ALLOWANCE else None
            tensors = load_safetensors(blob)
        except (SafetensorError, ValueError, UnicodeDecodeError) as exc:
            raise _Invalid(f"not a safetensors file ({exc})") from None
        metadata = (header or {}).get("__metadata__") or {}
        if metadata.get("format") != FORMAT:
            raise _Invalid(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
        if metadata.get("digest") != name:
            raise _Invalid("its recorded digest is not its name")
        if metadata.get("model_key") != self.model_key:
            raise _Invalid("it holds another model's KV")
        if set(tensors) != {"kv"}:
            raise _Invalid(f"tensors {sorted(tensors)}, expected only 'kv'")
        tensor = tensors["kv"]
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.block_shape:
            raise _Invalid(f"a {tensor.dtype} {tuple(tensor.shape)} block, expected {self.dtype} {self.block_shape}")
        if hashlib.sha256(_tensor_bytes(tensor)).hexdigest() != metadata.get("sha256"):
            raise _Invalid("its checksum does not match its contents")
        return tensor

    def _measure(self, seconds: float, nbytes: int) -> None:
        latest = seconds / max(nbytes, 1)
        previous = self._seconds_per_byte
        self._seconds_per_byte = latest if previous is None else (1 - _EMA) * previous + _EMA * latest

    def load_seconds(self, nbytes: int) -> float:
        """The measured (or, before any load, the assumed) time to load `nbytes` of blocks."""
        rate = self._seconds_per_byte if self._seconds_per_byte is not None else _PRIOR_SECONDS_PER_BYTE
        return rate * nbytes

    def clear(self) -> int:
        """Delete every block; returns how many."""
        with self._lock:
            names = list(self._sizes)
            for name in names:
                self._forget(name)
            return len(names)

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(len(self._sizes), self._bytes, self.budget_bytes, self._stored,
                                 self._loaded, self._refused, self._evicted, self._seconds_per_byte)


class _Invalid(Exception):
    pass


def directory_usage(directory: str | os.PathLike) -> tuple[int, int]:
    """(blocks, bytes) of the tier in `directory`, for `ttftc cache`: its block files only, nothing followed."""
    blocks = nbytes = 0
    for entry in os.scandir(directory):
        if _NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
            blocks += 1
            nbytes += entry.stat(follow_symlinks=False).st_size
    return blocks, nbytes


def clear_directory(directory: str | os.PathLike) -> int:
    """Delete the tier's block and temporary files in `directory` (nothing else in it); returns how many."""
    removed = 0
    for entry in os.scandir(directory):
        if (_NAME.match(entry.name) or _TMP.match(entry.name)) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
            removed += 1
    return removed


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()
