"""The prefix cache's disk tier: KV blocks evicted from RAM, kept in a directory, found again after a restart.

A block on disk is addressed by a digest chain, never by its tokens: the root is sha256 over the model's key and the
namespace (the tenant, or the cache's shared default), and each block's digest is sha256 over its parent's digest
and its own token ids. Two tenants, or two models, therefore never address the same file, and a file name tells
nothing about the prompt. A file's body does: it holds the block's token ids (below), as its KV, computed from
them, already all but did; the directory is as private as the prompts it caches.

A name is not proof of content: anyone who can write the directory can copy one tenant's block under another's name
and recompute its metadata and checksum. So each block also records what it must be the KV of (its `BlockAddress`):
its own token ids, its parent's digest (which covers the model, the namespace and every earlier token of the
prefix) and a digest of its namespace, and every hit compares them with the request's, exactly. A block written
for other tokens, another prefix or another tenant is refused. That stops a block copied or misplaced under another
name; it does not authenticate the writer: whoever can write the directory and knows a prompt's tokens can write
KV for them (a keyed MAC, with its key kept outside the directory, would be what stops that).

Every file in the directory is untrusted input, exactly like an artifact: it is read as a regular file (no
symlinks) no larger than a block can be, parsed as safetensors (data only), and accepted only when its metadata
names this format, its own digest and this model's key, its recorded tokens, parent and namespace are the
request's, and it holds exactly a tensor `tokens` and a tensor `kv` of the block's dtype and shape, finite, whose
sha256 matches the one recorded. Anything else, any parse error included (a header nested deep enough to exhaust
the recursion limit), is refused with a warning, deleted and counted: the next request sharing the prefix is a
clean miss, also after a restart. Nothing read here becomes code, and nothing outside the directory is touched
(names are 64 hex digits plus ".safetensors", built here). Files are written to a temporary name and renamed, so a
reader never sees half a block; a crash can leave at most a stale temporary file, which the next start removes.

The tier is bounded by `budget_bytes`: storing past it deletes the least recently used blocks (by the time they
were written or last loaded). Every header field has a fixed length, so all blocks of a tier have one file size
(`file_bytes`); the start-up scan deletes a file named like a block of any other size instead of counting it: a
huge file (a sparse terabyte costs nothing to make) cannot make the budget evict the valid blocks.

Whether a hit is loaded or recomputed is the prefix cache's decision (PrefixCache.match): it loads while the
measured load time of the blocks is below the measured recompute time of their tokens. `load_seconds_per_byte`
is measured on every load here.
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
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ttftc.cache.atomic import atomic_path
from ttftc.confined import UnsafePathError, read_regular

FORMAT = "ttftc-kv-block-2"  # 2: a block records its tokens, its parent's digest and its namespace
_NAME = re.compile(r"^([0-9a-f]{64})\.safetensors$")
_TMP = re.compile(r"^\.[0-9a-f]{64}\.safetensors\..*\.tmp$")
_TOKEN_DTYPE = torch.int64
_MAX_MODEL_KEY = 1024  # recorded in every block's header; model_key() gives 64 hex digits
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
class BlockAddress:
    """One block's place in the tier and what its file must hold to be served for it.

    `digest` names the file; `parent` is the digest above it (the root's for a first block), which covers the
    model, the namespace and every earlier token; `namespace` is a digest of the namespace's label; `tokens` are
    the block's own ids. The prefix cache keeps one per block it holds (O(1) each: the prefix is in `parent`).
    """

    digest: bytes
    parent: bytes
    namespace: bytes
    tokens: tuple[int, ...]

    def hex(self) -> str:
        return self.digest.hex()


def root_address(model_key: str, namespace: str) -> BlockAddress:
    """The chain's root (no file of its own): the address first blocks hang below."""
    label = hashlib.sha256(b"ttftc-kv-namespace\0" + namespace.encode()).digest()
    return BlockAddress(root_digest(model_key, namespace), b"", label, ())


def child_address(parent: BlockAddress, tokens: tuple[int, ...]) -> BlockAddress:
    """The address of the block with `tokens` below `parent`."""
    tokens = tuple(int(t) for t in tokens)
    return BlockAddress(child_digest(parent.digest, tokens), parent.digest, parent.namespace, tokens)


@dataclass(frozen=True)
class DiskTierStats:
    blocks: int
    bytes: int
    budget_bytes: int
    stored: int
    loaded: int
    refused: int  # files that failed validation (on a load, or by their size at the start-up scan) and were deleted
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
        if not isinstance(model_key, str) or not model_key or len(model_key) > _MAX_MODEL_KEY:
            raise DiskTierError(f"the disk tier needs a non-empty model_key of at most {_MAX_MODEL_KEY} characters "
                                "naming the model whose KV it keeps (model_key() gives one)")
        if not isinstance(dtype, torch.dtype) or len(block_shape) < 2 or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in block_shape):
            raise DiskTierError(f"a block needs a torch dtype and a shape of positive ints [..., tokens, head_dim], "
                                f"got {dtype!r}, {block_shape!r}")
        self.dtype = dtype
        self.block_shape = tuple(block_shape)
        self.block_tokens = self.block_shape[-2]
        self.block_bytes = torch.Size(self.block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise DiskTierError(f"{self.directory} is not a directory; give --kv-disk a directory (it is created)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.model_key = model_key
        # Every field of a block's header has a fixed length, so every file of this tier has this one size: anything
        # else named like a block is not one (another format or model, or a crafted file), whatever it holds.
        blank = BlockAddress(b"\0" * 32, b"\0" * 32, b"\0" * 32, (0,) * self.block_tokens)
        self.file_bytes = len(self._serialized(blank, torch.zeros(self.block_shape, dtype=dtype)))
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
        """Index the blocks a previous process left (oldest first by mtime); remove its stale temporary files, and
        files named like blocks whose size no block of this tier has (another format, a crafted file)."""
        found, implausible = [], 0
        for entry in os.scandir(self.directory):
            if _TMP.match(entry.name) and entry.is_file(follow_symlinks=False):
                _unlink(entry.path)
                continue
            match = _NAME.match(entry.name)
            if match and entry.is_file(follow_symlinks=False):
                info = entry.stat(follow_symlinks=False)
                if info.st_size != self.file_bytes:
                    _unlink(entry.path)
                    implausible += 1
                    continue
                found.append((info.st_mtime, match.group(1), info.st_size))
        if implausible:
            self._refused += implausible
            warnings.warn(f"ttftc KV disk tier: deleted {implausible} file(s) in {self.directory} named like blocks "
                          f"whose size is not a block's of this tier ({self.file_bytes} bytes)", stacklevel=3)
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

    def _forget(self, digest: str) -> Optional[OSError]:
        """Drop a block from the index and delete its file; the error when something there cannot be deleted (a
        directory put in its place): it is no longer indexed either way."""
        self._bytes -= self._sizes.pop(digest, 0)
        self._used.pop(digest, None)
        return _unlink(self._path(digest))

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

    def contains(self, address: BlockAddress) -> bool:
        with self._lock:
            return address.hex() in self._sizes

    def store(self, address: BlockAddress, payload: torch.Tensor) -> bool:
        """Write one block (a no-op if it is there already); False when it cannot fit the budget."""
        if not isinstance(address, BlockAddress) or len(address.tokens) != self.block_tokens:
            shown = repr(address)[:200]
            raise ValueError(f"a block is stored at a BlockAddress of {self.block_tokens} tokens, got {shown}")
        if payload.dtype != self.dtype or tuple(payload.shape) != self.block_shape:
            raise ValueError(f"a {payload.dtype} {tuple(payload.shape)} block; this tier holds {self.dtype} "
                             f"{self.block_shape}")
        name = address.hex()
        blob = self._serialized(address, payload)
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

    def _serialized(self, address: BlockAddress, payload: torch.Tensor) -> bytes:
        data = payload.detach().to("cpu").contiguous()
        metadata = {"format": FORMAT, "digest": address.hex(), "model_key": self.model_key,
                    "parent": address.parent.hex(), "namespace": address.namespace.hex(),
                    "sha256": hashlib.sha256(_tensor_bytes(data)).hexdigest()}
        return save_safetensors({"kv": data, "tokens": torch.tensor(address.tokens, dtype=_TOKEN_DTYPE)},
                                metadata=metadata)

    def load(self, address: BlockAddress) -> Optional[torch.Tensor]:
        """The block at `address` when its file is there, valid for this model, dtype and shape, and holds the KV
        of exactly the address's tokens, prefix and namespace; else None (an invalid file is deleted, with a
        warning naming why)."""
        name = address.hex()
        with self._lock:
            if name not in self._sizes:
                return None
            start = time.perf_counter()
            try:
                blob = read_regular(self._path(name), limit=self.file_bytes)
                tensor = self._validated(address, blob)
            except FileNotFoundError:
                self._forget(name)  # removed behind our back: a miss, nothing to refuse
                return None
            except (UnsafePathError, _Invalid) as exc:
                failed = self._forget(name)
                self._refused += 1
                outcome = "deleted it" if failed is None else f"could not delete it ({failed.strerror or failed})"
                warnings.warn(f"ttftc KV disk tier: refused {self._path(name)}: {exc}; {outcome}", stacklevel=2)
                return None
            self._measure(time.perf_counter() - start, len(blob))
            self._touch(name)
            self._loaded += 1
            return tensor

    def _validated(self, address: BlockAddress, blob: bytes) -> torch.Tensor:
        try:
            # safetensors' own parser first: it bounds the header's nesting, so json.loads below sees a flat header.
            tensors = load_safetensors(blob)
            header_len = int.from_bytes(blob[:8], "little")
            header = json.loads(blob[8:8 + header_len])
            metadata = header.get("__metadata__") if isinstance(header, dict) else None
            if not isinstance(metadata, dict):
                raise ValueError("no metadata")
        except Exception as exc:  # any parse error is a refusal: RecursionError, MemoryError, SafetensorError...
            shown = f"{type(exc).__name__}: {exc}"
            raise _Invalid(f"not a KV block file ({shown[:200]})") from None
        if metadata.get("format") != FORMAT:
            raise _Invalid(f"format {str(metadata.get('format'))[:80]!r}, expected {FORMAT!r}")
        if metadata.get("digest") != address.hex():
            raise _Invalid("its recorded digest is not its name")
        if metadata.get("model_key") != self.model_key:
            raise _Invalid("it holds another model's KV")
        if metadata.get("namespace") != address.namespace.hex():
            raise _Invalid("it was written for another tenant's namespace")
        if metadata.get("parent") != address.parent.hex():
            raise _Invalid("it continues another prefix than the request's")
        if set(tensors) != {"kv", "tokens"}:
            raise _Invalid(f"tensors {sorted(tensors)[:8]}, expected 'kv' and 'tokens'")
        tokens = tensors["tokens"]
        if tokens.dtype != _TOKEN_DTYPE or tuple(tokens.shape) != (len(address.tokens),) or \
                tuple(tokens.tolist()) != address.tokens:
            raise _Invalid("its recorded tokens are not the request's")
        tensor = tensors["kv"]
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.block_shape:
            raise _Invalid(f"a {tensor.dtype} {tuple(tensor.shape)} block, expected {self.dtype} {self.block_shape}")
        if hashlib.sha256(_tensor_bytes(tensor)).hexdigest() != metadata.get("sha256"):
            raise _Invalid("its checksum does not match its contents")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise _Invalid("it holds non-finite values (NaN or Inf)")
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


def _unlink(path: str | os.PathLike) -> Optional[OSError]:
    """Delete a file of the tier (a symlink itself, never its target); the error if something else is there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # a directory in a block's place, a read-only directory
        return exc
    return None


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()
