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
(names are 64 hex digits plus ".safetensors", built here).

One directory is shared by every process that opens a tier on it (the replicas of a fleet on one machine, or on a
shared mount): there is no lock file and no writer to elect, because a block's name is its content address and
every file is verified when it is hit anyway.
- Publishing: a block is written to a temporary name of its writer's own (`.<digest>.safetensors.<host>-<pid>-
  <random>.tmp`, created exclusively in the same directory) and renamed over its name, so a reader sees the whole
  block or none. Two writers of one block both succeed (the last rename wins; either file is valid KV of the same
  tokens), and a writer that finds the block published already writes nothing. There is no fsync: a block torn by a
  power loss fails its verification and is a miss, and a flush per block would sit in the eviction path.
- Finding: a lookup that misses the in-memory index checks the block's file on disk (one lstat: a regular file of
  a block's size), so a block another process wrote after this one started is found, and verified like any other.
  A new process indexes the blocks already there, so it starts warm.
- Temporary files: the start-up scan deletes only stale ones: older than `STALE_TEMPORARY_S`, or written on this
  machine and pid namespace (`host_identity()`) by a process that no longer runs. A live writer's is kept.
- The budget: each process keeps the directory within `budget_bytes` as far as it sees it: the block files of its
  latest listing of the directory (at start-up, then every `rescan_s` seconds on a thread of its own while it
  stores, so that no store waits for one), plus those it wrote or found since. Over it, it deletes the blocks used
  longest ago, by file mtime, whoever wrote them: a write or a load sets its block's mtime, and the victim's mtime
  is checked before it is deleted, so that is "least recently used" across processes. The directory can so exceed
  the budget by what the other processes wrote since the listing. Give every process on one directory the same
  budget: one with a smaller budget trims the directory to its own. A block deleted just before another process
  reads it is a clean miss for that reader, as any file removed behind a tier's back is.

Every header field has a fixed length, so all blocks of a tier have one file size (`file_bytes`); the start-up scan
deletes a file named like a block of any other size instead of counting it, the listings never index one, and a hit
refuses one: a huge file (a sparse terabyte costs nothing to make) cannot make the budget evict the valid blocks.

Whether a hit is loaded or recomputed is the prefix cache's decision (PrefixCache.match): it loads while the
measured load time of the blocks is below the measured recompute time of their tokens. `load_seconds_per_byte`
is measured on every load here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import secrets
import stat
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ttftc.confined import UnsafePathError, read_regular

FORMAT = "ttftc-kv-block-2"  # 2: a block records its tokens, its parent's digest and its namespace
_NAME = re.compile(r"^([0-9a-f]{64})\.safetensors$")
_TMP = re.compile(r"^\.[0-9a-f]{64}\.safetensors\.(.*)\.tmp$")  # group 1: the writer (see _temporary_name)
_WRITER = re.compile(r"^([0-9a-f]{16})-([1-9][0-9]{0,9})-[0-9a-f]{12}$")  # host identity, pid, random
_MAX_PID = (1 << 31) - 1  # os.kill takes a C int; Linux pids stay far below (pid_max <= 2**22)
# A temporary file this old is a dead writer's, wherever it ran: a block is written in milliseconds, and minutes
# leave room for a slow shared mount and some clock skew between its clients.
STALE_TEMPORARY_S = 600.0
# How often a tier that stores lists the directory again (in the background): other processes' blocks count against
# its budget from then. A listing of 10,000 blocks took 15-80 ms of CPU on a busy 2-core machine.
RESCAN_S = 5.0
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
    """A bounded directory of KV blocks of one model; thread-safe, and shareable by processes (module docstring).

    `model_key` names the weights whose KV the blocks hold (a digest of them: two models never share a block);
    `dtype` and `block_shape` are one block's, exactly as the prefix cache holds it. `rescan_s`: how often a tier that
    stores lists the directory again, in the background (other processes' blocks count against the budget from then).
    """

    def __init__(self, directory: str | os.PathLike, budget_bytes: int, *, model_key: str, dtype: torch.dtype,
                 block_shape: tuple[int, ...], rescan_s: float = RESCAN_S):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise DiskTierError(f"the disk tier's byte budget must be a positive integer, got {budget_bytes!r}")
        if not isinstance(model_key, str) or not model_key or len(model_key) > _MAX_MODEL_KEY:
            raise DiskTierError(f"the disk tier needs a non-empty model_key of at most {_MAX_MODEL_KEY} characters "
                                "naming the model whose KV it keeps (model_key() gives one)")
        if not isinstance(dtype, torch.dtype) or len(block_shape) < 2 or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in block_shape):
            raise DiskTierError(f"a block needs a torch dtype and a shape of positive ints [..., tokens, head_dim], "
                                f"got {dtype!r}, {block_shape!r}")
        if isinstance(rescan_s, bool) or not isinstance(rescan_s, (int, float)) or not rescan_s >= 0:
            raise DiskTierError(f"rescan_s must be a non-negative number of seconds, got {rescan_s!r}")
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
        self.rescan_s = float(rescan_s)
        # Every field of a block's header has a fixed length, so every file of this tier has this one size: anything
        # else named like a block is not one (another format or model, or a crafted file), whatever it holds.
        blank = BlockAddress(b"\0" * 32, b"\0" * 32, b"\0" * 32, (0,) * self.block_tokens)
        self.file_bytes = len(self._serialized(blank, torch.zeros(self.block_shape, dtype=dtype)))
        self._lock = threading.Lock()
        # The index: hex digest -> last use in ns (its file's mtime, or this process's own later use) of every block
        # file this process knows of. All have one size, file_bytes, so the index is also the byte count.
        self._used: dict[str, int] = {}
        self._clock = 0  # the latest _tick()
        self._changed: Optional[set[str]] = None  # while a listing runs: digests indexed or dropped meanwhile
        self._listing = threading.Lock()  # one listing at a time
        self._listing_due = float("inf")  # time.monotonic() after which a store starts a listing
        self._listing_started = False  # a store started one that has not ended
        self._stored = self._loaded = self._refused = self._evicted = 0
        self._seconds_per_byte: Optional[float] = None
        with self._lock:
            started = time.monotonic()
            self._scan()
            self._fit(0)
            self._listing_due = started + self._listing_interval(time.monotonic() - started)

    # ---- the directory ------------------------------------------------------------------------------------------

    def _scan(self) -> None:
        """At start-up: index the block files in the directory, whoever wrote them, by their mtimes; delete stale
        temporary files (never a live writer's) and files named like blocks whose size no block of this tier has
        (another format, a crafted file)."""
        implausible = 0
        now = time.time()
        for entry in os.scandir(self.directory):
            try:
                temporary = _TMP.match(entry.name)
                if temporary:
                    if entry.is_file(follow_symlinks=False) and _stale_temporary(
                            temporary.group(1), entry.stat(follow_symlinks=False).st_mtime, now):
                        _unlink(entry.path)
                    continue
                match = _NAME.match(entry.name)
                if not match or not entry.is_file(follow_symlinks=False):
                    continue
                info = entry.stat(follow_symlinks=False)
            except OSError:  # gone between the listing and its stat: another process renamed or deleted it
                continue
            if info.st_size != self.file_bytes:
                _unlink(entry.path)
                implausible += 1
                continue
            self._used[match.group(1)] = info.st_mtime_ns
        if implausible:
            self._refused += implausible
            warnings.warn(f"ttftc KV disk tier: deleted {implausible} file(s) in {self.directory} named like blocks "
                          f"whose size is not a block's of this tier ({self.file_bytes} bytes)", stacklevel=3)

    def refresh(self) -> None:
        """List the directory again and keep it within the budget: the blocks other processes wrote since the last
        listing count from now on, and those they deleted no longer do. A store starts one on a thread of its own
        when the last is `rescan_s` old, so no store waits for a listing (which takes long in a big directory)."""
        with self._listing:
            started = time.monotonic()
            with self._lock:
                known = set(self._used)
                self._changed = set()
            try:
                listed = self._list(known)  # without the lock: stores and loads go on meanwhile
            except BaseException:
                with self._lock:
                    self._changed = None
                raise
            with self._lock:
                # What this process wrote, found or dropped while the listing ran is newer than the listing.
                used = {digest: self._used[digest] if mtime is None else mtime for digest, mtime in listed.items()
                        if digest not in self._changed and (mtime is not None or digest in self._used)}
                used.update((digest, self._used[digest]) for digest in self._changed if digest in self._used)
                self._used, self._changed = used, None
                self._fit(0)
                self._listing_due = started + self._listing_interval(time.monotonic() - started)

    def _list(self, known: set[str]) -> dict[str, Optional[int]]:
        """The block files in the directory: digest -> mtime in ns, None for those in `known` (not looked at again:
        a later use of one by another process is checked when it is about to be evicted)."""
        listed: dict[str, Optional[int]] = {}
        for entry in os.scandir(self.directory):
            match = _NAME.match(entry.name)
            if not match or not entry.is_file(follow_symlinks=False):
                continue
            if match.group(1) in known:
                listed[match.group(1)] = None
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:  # gone since the listing
                continue
            if info.st_size == self.file_bytes:  # another size is no block: the next start-up scan deletes it
                listed[match.group(1)] = info.st_mtime_ns
        return listed

    def _listing_interval(self, took: float) -> float:
        # Listing at most 1/50 of the time: a directory of many small blocks takes a while to list.
        return max(self.rescan_s, 50 * took)

    def _start_listing(self) -> None:
        """Start a listing in the background if one is due (the lock is held)."""
        if self._listing_started or time.monotonic() < self._listing_due:
            return
        self._listing_started = True
        threading.Thread(target=self._list_in_background, name="ttftc-kv-disk-listing", daemon=True).start()

    def _list_in_background(self) -> None:
        try:
            self.refresh()
        except OSError as exc:  # the directory was removed or became unreadable: the next store tries again
            warnings.warn(f"ttftc KV disk tier: could not list {self.directory} ({exc})", stacklevel=1)
        finally:
            with self._lock:
                self._listing_started = False
                self._listing_due = max(self._listing_due, time.monotonic() + self.rescan_s)

    @property
    def _bytes(self) -> int:
        return len(self._used) * self.file_bytes

    def _path(self, digest: str) -> Path:
        return self.directory / f"{digest}.safetensors"

    def _index(self, digest: str, used_ns: int) -> None:
        self._used[digest] = used_ns
        if self._changed is not None:
            self._changed.add(digest)

    def _drop(self, digest: str) -> None:
        """Forget a block (its file is gone, or is no block), deleting nothing."""
        self._used.pop(digest, None)
        if self._changed is not None:
            self._changed.add(digest)

    def _published(self, digest: str) -> bool:
        """Whether a block file is in place (a regular file of a block's size: one lstat, nothing read) and now
        indexed; False drops it from the index (without deleting anything)."""
        try:
            info = os.lstat(self._path(digest))
        except OSError:
            info = None
        if info is None or not stat.S_ISREG(info.st_mode) or info.st_size != self.file_bytes:
            self._drop(digest)
            return False
        if digest not in self._used:  # another process wrote it after our listing
            self._index(digest, info.st_mtime_ns)
        return True

    def _tick(self) -> int:
        """Now, in ns, and later than any earlier tick: two uses in one clock tick stay ordered."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _touch(self, digest: str) -> None:
        """Mark a block used now, here and in its file's mtime (set to the same ns), so other processes see it so."""
        now = self._tick()
        self._index(digest, now)
        if os.utime in os.supports_follow_symlinks:
            try:
                os.utime(self._path(digest), ns=(now, now), follow_symlinks=False)
            except OSError:  # another user's file, a read-only mount: the order is this process's alone then
                pass

    def _forget(self, digest: str) -> Optional[OSError]:
        """Drop a block from the index and delete its file; the error when something there cannot be deleted (a
        directory put in its place): it is no longer indexed either way."""
        self._drop(digest)
        return _unlink(self._path(digest))

    def _fit(self, incoming: int) -> bool:
        """Delete the blocks used longest ago until `incoming` more bytes fit; False if they never can."""
        if incoming > self.budget_bytes:
            return False
        while self._used and self._bytes + incoming > self.budget_bytes:
            oldest = min(self._used, key=self._used.get)
            try:
                used_elsewhere = os.lstat(self._path(oldest)).st_mtime_ns
            except OSError:
                used_elsewhere = 0
            if used_elsewhere > self._used[oldest]:  # another process used it since: look again with that
                self._index(oldest, used_elsewhere)
                continue
            self._forget(oldest)
            self._evicted += 1
        return True

    # ---- blocks -------------------------------------------------------------------------------------------------

    def contains(self, address: BlockAddress) -> bool:
        """Whether the block's file is there: in the index, or published since by another process (looked up)."""
        name = address.hex()
        with self._lock:
            return name in self._used or self._published(name)

    def store(self, address: BlockAddress, payload: torch.Tensor) -> bool:
        """Write one block (a no-op if its file is there already, whoever wrote it); False when it cannot fit the
        budget."""
        if not isinstance(address, BlockAddress) or len(address.tokens) != self.block_tokens:
            shown = repr(address)[:200]
            raise ValueError(f"a block is stored at a BlockAddress of {self.block_tokens} tokens, got {shown}")
        if payload.dtype != self.dtype or tuple(payload.shape) != self.block_shape:
            raise ValueError(f"a {payload.dtype} {tuple(payload.shape)} block; this tier holds {self.dtype} "
                             f"{self.block_shape}")
        name = address.hex()
        blob = self._serialized(address, payload)
        with self._lock:
            self._start_listing()
            if self._published(name):  # checked on disk: another process may have deleted an indexed one
                self._touch(name)
                return True
            if not self._fit(len(blob)):
                return False
            now = self._tick()
            _publish(self._path(name), blob, mtime_ns=now)
            self._index(name, now)
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
        """The block at `address` when its file is there (indexed, or published since by another process), exactly
        a block's size, valid for this model, dtype and shape, and holds the KV of exactly the address's tokens,
        prefix and namespace; else None (an invalid file is deleted, with a warning naming why)."""
        name = address.hex()
        with self._lock:
            if name not in self._used and not self._published(name):
                return None
            start = time.perf_counter()
            try:
                blob = read_regular(self._path(name), limit=self.file_bytes)
                if len(blob) != self.file_bytes:
                    raise _Invalid(f"{len(blob)} bytes, not a block's {self.file_bytes}")
                tensor = self._validated(address, blob)
            except FileNotFoundError:
                # Deleted behind our back (another process's budget, a clear): a miss, nothing to refuse.
                self._drop(name)
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
            names = list(self._used)
            for name in names:
                self._forget(name)
            return len(names)

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(len(self._used), self._bytes, self.budget_bytes, self._stored,
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


@functools.lru_cache(maxsize=1)
def host_identity() -> Optional[str]:
    """16 hex digits naming this boot of this machine and this pid namespace: two processes with the same identity
    see each other's pids, so a temporary file's writer can be checked for being alive. None where that cannot be
    told (no /proc): such writers' files are judged by their age alone."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        pid_namespace = os.readlink("/proc/self/ns/pid")
    except (OSError, ValueError):
        return None
    if not boot:
        return None
    return hashlib.sha256(f"ttftc-kv-writer\0{boot}\0{pid_namespace}".encode()).hexdigest()[:16]


def _temporary_name(final: Path) -> Path:
    """A name next to `final` that no other writer uses: this writer's host identity and pid (so a start-up scan can
    tell whether it still runs) and 48 random bits (threads of one process)."""
    writer = f"{host_identity() or 'unknown'}-{os.getpid()}-{secrets.token_hex(6)}"
    return final.with_name(f".{final.name}.{writer}.tmp")


def _publish(final: Path, blob: bytes, *, mtime_ns: int) -> None:
    """Write `blob` to `final` atomically: a file of this writer's own, created exclusively (never through a link
    planted there), stamped `mtime_ns` (the writer's clock: the order of use every process reads), renamed over
    `final`; removed on any failure."""
    temporary = _temporary_name(final)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temporary, flags, 0o600)
    try:
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
            if os.utime in os.supports_fd:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(fd)
        os.replace(temporary, final)
    except BaseException:
        _unlink(temporary)
        raise


def _stale_temporary(writer: str, mtime: float, now: float) -> bool:
    """Whether a temporary file is a dead writer's: older than STALE_TEMPORARY_S, or written under this host
    identity by a pid that no longer runs. A live writer's file (or one whose writer cannot be told) is kept."""
    if now - mtime > STALE_TEMPORARY_S:
        return True
    match = _WRITER.match(writer)
    if match is None or host_identity() is None or match.group(1) != host_identity():
        return False
    pid = int(match.group(2))
    return pid <= _MAX_PID and not _running(pid)


def _running(pid: int) -> bool:
    """Whether a process `pid` (> 0) exists in this pid namespace: signal 0 checks without sending anything."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user's
        return True
    return True


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()
