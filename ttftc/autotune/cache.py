"""The persistent autotune cache: one small JSON file per tuned problem, in a directory.

Keyed by device name, op, shape signature, dtype and provider; versions of ttftc, torch and triton are stored
in each entry and checked on read, so a stale entry (another version) is ignored instead of trusted. Writes go
to a temporary file in the same directory and are renamed into place, so a reader never sees half a file and
concurrent writers cannot interleave bytes (the last rename wins, whole). A corrupt or stale entry is skipped
with one warning per cache and never raises. Entries are untrusted data: each field must have its type (a config
maps knob names to JSON scalars), and a stored thread count is clamped where it is applied (codegen/cpu/_threads.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch

import ttftc
from ttftc.autotune.space import knob_reason
from ttftc.confined import UnsafePathError, read_regular

SCHEMA = 1
# An entry is a few hundred bytes; a file much larger is not one (and a link to /dev/zero is refused before this).
MAX_ENTRY_BYTES = 1 << 20
DIR_ENV = "TTFTC_AUTOTUNE_CACHE"  # the autotune directory itself
ROOT_ENV = "TTFTC_CACHE_DIR"  # ttftc's cache root; autotune/ below it


def default_cache_dir() -> Path:
    """Where compiles look for tuned configs: $TTFTC_AUTOTUNE_CACHE, else $TTFTC_CACHE_DIR/autotune, else
    ~/.cache/ttftc/autotune."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    root = os.environ.get(ROOT_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "ttftc")
    return Path(root) / "autotune"


def current_versions() -> dict[str, str]:
    try:
        import triton  # lazy: optional; its module's version, which triton-ascend sets under another package name

        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    return {"ttftc": ttftc.__version__, "torch": torch.__version__, "triton": triton_version}


@dataclass(frozen=True)
class TuneKey:
    device: str  # e.g. "cpu:Intel(R) Xeon(R) ...:2 threads" or "cuda:NVIDIA H100"
    op: str
    provider: str
    shapes: str  # a canonical signature of argument shapes and scalar options
    dtype: str

    def digest(self) -> str:
        payload = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _checked_config(raw: Any) -> dict[str, Any]:
    """A tuned config from a file: knob names mapped to JSON scalars; raises ValueError otherwise."""
    if not isinstance(raw, dict):
        raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
    for name, value in raw.items():
        if not isinstance(name, str) or not (value is None or isinstance(value, (bool, int, float, str))):
            raise ValueError(f"config knob {name!r} has a non-scalar value {value!r}"[:200])
    threads = raw.get("num_threads")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ValueError(f"config num_threads must be a positive int or null, got {threads!r}")
    return dict(raw)


def _checked_strings(raw: Any, what: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ValueError(f"{what} must map names to strings")
    return raw


@dataclass(frozen=True)
class TuneEntry:
    key: TuneKey
    config: dict[str, Any]
    tuned_ms: float
    default_ms: float
    versions: dict[str, str]
    created: float


class AutotuneCache:
    def __init__(self, directory: Optional[os.PathLike] = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self._warned = False

    # -- reading --------------------------------------------------------------------------------------------
    def _warn_once(self, message: str) -> None:
        if not self._warned:
            warnings.warn(f"ttftc autotune cache {self.directory}: {message}; ignoring it (retune to refresh)")
            self._warned = True

    def _read(self, path: Path) -> Optional[TuneEntry]:
        try:
            raw = json.loads(read_regular(path, limit=MAX_ENTRY_BYTES))
            if raw.get("schema") != SCHEMA:
                raise ValueError(f"schema {raw.get('schema')!r}, expected {SCHEMA}")
            entry = TuneEntry(
                key=TuneKey(**_checked_strings(raw["key"], "key")),
                config=_checked_config(raw["config"]),
                tuned_ms=float(raw["tuned_ms"]),
                default_ms=float(raw["default_ms"]),
                versions=dict(_checked_strings(raw["versions"], "versions")),
                created=float(raw["created"]),
            )
        except FileNotFoundError:
            return None
        except Exception as exc:  # truncated, hand-edited, or from an incompatible release
            self._warn_once(f"corrupt entry {path.name} ({type(exc).__name__}: {exc})")
            return None
        if entry.key.digest() != path.stem:
            self._warn_once(f"entry {path.name} does not match its own key")
            return None
        return entry

    def lookup(self, key: TuneKey, *, axes: Optional[Mapping[str, tuple]] = None) -> Optional[TuneEntry]:
        """The entry stored for `key`, if it is fresh and, with `axes` (autotune.space.tuning_axes of the op whose
        kernel will read it), its config is a point of that space: a knob reaches a kernel as a block or buffer
        size, so a file must not choose it freely."""
        entry = self._read(self.directory / f"{key.digest()}.json")
        if entry is None:
            return None
        if entry.versions != current_versions():
            self._warn_once(f"stale entry for {key.op} (tuned with {entry.versions}, running {current_versions()})")
            return None
        reason = None if axes is None else knob_reason(entry.config, axes)
        if reason is not None:
            self._warn_once(f"entry for {key.op} has a config outside its autotune space ({reason})")
            return None
        return entry

    def entries(self) -> Iterator[TuneEntry]:
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.glob("*.json")):
            entry = self._read(path)
            if entry is not None:
                yield entry

    def fresh_entries(self) -> Iterator[TuneEntry]:
        """The entries tuned with the running versions of ttftc, torch and triton (stale ones warn once)."""
        versions = current_versions()
        for entry in self.entries():
            if entry.versions == versions:
                yield entry
            else:
                self._warn_once(f"stale entry for {entry.key.op} (tuned with {entry.versions}, running {versions})")

    def content_digest(self) -> str:
        """A hash of every stored entry's bytes: it changes whenever `ttftc autotune` stores or replaces a config, so
        compiled graphs that baked the old configs in (the compile cache) are keyed apart from ones built after."""
        digest = hashlib.sha256()
        if self.directory.is_dir():
            for path in sorted(self.directory.glob("*.json")):
                try:
                    digest.update(path.name.encode() + b"\0" + read_regular(path, limit=MAX_ENTRY_BYTES))
                except (OSError, UnsafePathError):  # removed while listing, or no entry (a FIFO, a link to
                    continue  # /dev/zero, too large): it holds nothing a compile could have used
        return digest.hexdigest()[:16]

    # -- writing --------------------------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Raise a clear error now rather than after minutes of tuning."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".probe-"):
                pass
        except OSError as exc:
            raise PermissionError(
                f"autotune cache directory {self.directory} is not writable ({exc.strerror or exc}); "
                f"pass a writable --cache DIR or set {DIR_ENV}"
            ) from None

    def store(self, key: TuneKey, config: dict[str, Any], tuned_ms: float, default_ms: float) -> TuneEntry:
        entry = TuneEntry(key, dict(config), tuned_ms, default_ms, current_versions(), time.time())
        payload = {
            "schema": SCHEMA,
            "key": dataclasses.asdict(key),
            "config": entry.config,
            "tuned_ms": tuned_ms,
            "default_ms": default_ms,
            "versions": entry.versions,
            "created": entry.created,
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key.digest()}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.directory / f"{key.digest()}.json")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return entry

