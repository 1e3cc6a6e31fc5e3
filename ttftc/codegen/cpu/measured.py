"""CPU choices measured on this machine, kept across processes in one JSON file under ttftc's cache directory.

Why: the CPU defaults (the int8 GEMM, the float GEMM backend, the attention kernel, native bf16, the decode GEMM)
are measured, never assumed. Measured afresh in every process, two processes on a loaded machine can decide
differently, and native bf16 and bf16 attention join the precision pass's uuid: the compile-cache key then forks
on noise and every graph compiles again. So each choice is measured once per machine and reused by every process;
`ttftc autotune --cpu` measures them again.

A machine's record is keyed by what a measurement depends on (`machine_key`): the CPU model, its flags, the core
count, torch's thread count, the torch and ttftc versions, and the instruction sets the kernels are held to
(ONEDNN_MAX_CPU_ISA, the native kernels' ISA). The file is untrusted data: it is read through
confined.read_regular with a size limit, each choice's value is checked by its owner's `decode` (a schema, and
whether what it names can run here now), and anything wrong is measured again and overwritten, never an exception.
It is written whole to a temporary file and renamed, so a reader sees the old file or the new one.
Environment overrides (TTFTC_NATIVE_BF16, TTFTC_CPU_GEMM) are answered before a choice is recalled: never stored.

`prefer` is the one near-tie rule every choice uses: within NEAR_TIE of the fastest, a fixed order decides.

A choice measured while other processes kept the cores busy is provisional. On 2 shared cores, the int8 GEMMs
of oneDNN and ATen slowed 65-69x (fp32 12x) while ttftc's own kernel slowed 4.4x, so such a record names the
kernel that copes best with a crowd, not the fastest one (benchmarks/README.md, "Measured choices under load").
Each record says how busy the other processes kept the CPU while it was measured (`others_busy`, in cores, from
/proc/stat); a process that finds a busy record on a quiet machine measures again and replaces it. A busy record
found on a busy machine is used as it is, so processes that start together under load still agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

import torch

import ttftc
from ttftc.codegen.cpu import _native
from ttftc.confined import UnsafePathError, read_regular

try:
    import fcntl
except ImportError:  # not POSIX: the store is written without a lock
    fcntl = None

T = TypeVar("T")
SCHEMA = 1
ROOT_ENV = "TTFTC_CACHE_DIR"  # ttftc's cache root (as the compile and autotune caches read it)
STORE_ENV = "TTFTC_MACHINE_CHOICES"  # the file itself, where set
# A record is a few hundred bytes per choice; a file much larger is not one of ttftc's.
MAX_STORE_BYTES = 1 << 20
# Records of other machines (or versions) kept beside this one's: a shared home directory sees several.
MAX_MACHINES = 16
# Two timings closer than this are the same within the noise of a loaded machine (best-of-a-few on 2 shared
# cores): the choice between them goes to the fixed order, so noise cannot decide it.
NEAR_TIE = 0.05
# How long a process waits for another one's measurement before measuring alone: far longer than every choice's
# measurement together takes on a loaded machine, so only a process hung while holding the lock is skipped.
LOCK_WAIT_S = 300.0
# Other processes using more than this many cores (of the CPU's, while a choice is measured) make the machine busy.
BUSY_CORES = 0.5
# How long the CPU is watched to tell whether other processes are using it.
BUSY_WINDOW_S = 0.1


def prefer(times: Mapping[str, float], order: Sequence[str]) -> str:
    """The fastest of `times` (candidate -> time), except that every candidate within NEAR_TIE of the fastest
    counts as fastest and the earliest of them in `order` wins (candidates missing from `order` rank last)."""
    if not times:
        raise ValueError("prefer: no candidate was timed")
    best = min(times.values())
    close = [name for name, t in times.items() if t <= best * (1 + NEAR_TIE)]
    rank = {name: i for i, name in enumerate(order)}
    return min(close, key=lambda name: (rank.get(name, len(rank)), times[name], name))


@dataclass(frozen=True)
class Provenance:
    """Where a choice came from: measured by this process, or loaded from the machine's record."""

    measured_at: float  # seconds since the epoch
    loaded: bool
    store: str = ""
    others_busy: Optional[float] = None  # cores other processes used while it was measured; None: not known

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.measured_at))
        load = ("" if self.others_busy is None or self.others_busy <= BUSY_CORES
                else f", while other processes used {self.others_busy:.1f} cores: provisional")
        return (f"loaded from {self.store}, measured {when}" if self.loaded else f"measured now, {when}") + load


def _cpu_ticks() -> Optional[tuple[int, int]]:
    """(busy, total) clock ticks of the whole CPU since boot, from /proc/stat; None where it cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        ticks = [int(x) for x in fields[1:]]
    except (OSError, ValueError):
        return None
    if fields[0] != "cpu" or len(ticks) < 5:
        return None
    idle = ticks[3] + ticks[4]  # idle + iowait
    total = sum(ticks[:8])  # guest time is already counted in user
    return total - idle, total


def _own_ticks() -> Optional[int]:
    """This process's user + system clock ticks (all its threads), from /proc/self/stat."""
    try:
        text = Path("/proc/self/stat").read_text()
        fields = text[text.rindex(")") + 2:].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class CpuSnapshot:
    """The CPU's busy and total ticks and this process's own, at one moment (None where /proc cannot tell)."""

    busy: int
    total: int
    own: int


def cpu_snapshot() -> Optional[CpuSnapshot]:
    ticks, own = _cpu_ticks(), _own_ticks()
    return None if ticks is None or own is None else CpuSnapshot(ticks[0], ticks[1], own)


def others_busy_since(start: Optional[CpuSnapshot]) -> Optional[float]:
    """How many cores, on average, processes other than this one kept busy since `start`."""
    end = cpu_snapshot()
    if start is None or end is None or end.total <= start.total:
        return None
    others = (end.busy - start.busy) - (end.own - start.own)
    return max(0.0, others / (end.total - start.total) * (os.cpu_count() or 1))


def others_busy_cores(window_s: float = BUSY_WINDOW_S) -> Optional[float]:
    """How many cores processes other than this one keep busy over the next `window_s` (this one sleeps
    meanwhile); None where /proc cannot tell (not Linux)."""
    start = cpu_snapshot()
    time.sleep(window_s)
    return others_busy_since(start)


def cpu_flags_and_name() -> tuple[Optional[set[str]], str]:
    """The CPU's flags (None where /proc/cpuinfo cannot be read) and model name."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, platform.processor() or platform.machine()
    flags: Optional[set[str]] = None
    name = platform.machine()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("flags", "Features") and flags is None:
            flags = set(value.split())
        elif key in ("model name", "Model name") and name == platform.machine():
            name = value.strip()
    return flags, name


def machine_key() -> dict[str, Any]:
    """What a measurement here depends on; a record made under another key is never used."""
    flags, name = cpu_flags_and_name()
    flag_text = " ".join(sorted(flags)) if flags is not None else "unknown"
    return {"cpu": name, "flags": hashlib.sha256(flag_text.encode()).hexdigest()[:16], "cores": os.cpu_count() or 0,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "ttftc": ttftc.__version__,
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            "native_isa": (_native.isa() if _native.unavailable_reason() is None else None) or "unavailable"}


def _digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def store_path() -> Path:
    """$TTFTC_MACHINE_CHOICES, else $TTFTC_CACHE_DIR/machine/choices.json, else ~/.cache/ttftc/machine/..."""
    if os.environ.get(STORE_ENV):
        return Path(os.environ[STORE_ENV])
    root = os.environ.get(ROOT_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "ttftc")
    return Path(root) / "machine" / "choices.json"


def _read_store(path: Path) -> dict[str, Any]:
    """The file's machines (digest -> record), {} where it is absent; raises ValueError/UnsafePathError when it
    is not a store."""
    try:
        raw = json.loads(read_regular(path, limit=MAX_STORE_BYTES))
    except FileNotFoundError:
        return {}
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA or not isinstance(raw.get("machines"), dict):
        raise ValueError(f"not a schema-{SCHEMA} store of measured choices")
    return raw["machines"]


def _checked_record(record: Any, key: Mapping[str, Any]) -> dict[str, Any]:
    """This machine's choices (name -> {"value", "measured_at"}) from an untrusted record; {} if it is not one."""
    if not isinstance(record, dict) or record.get("key") != key or not isinstance(record.get("choices"), dict):
        return {}
    return record["choices"]


def _warn(path: Path, message: str) -> None:
    warnings.warn(f"ttftc measured CPU choices {path}: {message}; measuring again", RuntimeWarning, stacklevel=3)


def _stored(name: str, path: Path, key: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    try:
        machines = _read_store(path)
    except (ValueError, UnsafePathError, OSError, RecursionError) as exc:
        _warn(path, f"unreadable ({type(exc).__name__}: {str(exc)[:200]})")
        return None
    entry = _checked_record(machines.get(_digest(key)), key).get(name)
    return entry if isinstance(entry, dict) else None


def _dump(path: Path, machines: Mapping[str, Any]) -> None:
    """Write the store whole to a temporary file and rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"schema": SCHEMA, "machines": dict(machines)}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _other_machines(path: Path, digest: str) -> tuple[dict[str, Any], Any]:
    """(the other machines' records, up to MAX_MACHINES - 1 of them, this machine's record or None)."""
    try:
        machines = dict(_read_store(path))
    except (ValueError, UnsafePathError, OSError, RecursionError):
        machines = {}  # a damaged file is replaced whole
    mine = machines.pop(digest, None)
    # The file is written with sorted keys, so its order says nothing of age: keep the most recently measured.
    kept = sorted(machines, key=lambda other: _newest(machines[other]))[-(MAX_MACHINES - 1):]
    return {other: machines[other] for other in kept}, mine


def _newest(record: Any) -> float:
    """When a machine's record was last added to (0 for a record too damaged to say: it goes first)."""
    choices = record.get("choices") if isinstance(record, dict) else None
    if not isinstance(choices, dict):
        return 0.0
    times = [c.get("measured_at") for c in choices.values() if isinstance(c, dict)]
    return max((t for t in times if isinstance(t, (int, float)) and not isinstance(t, bool)), default=0.0)


def _write(path: Path, name: str, value: Any, measured_at: float, key: Mapping[str, Any],
           others_busy: Optional[float]) -> None:
    """Add or replace one choice in this machine's record, keeping the other machines' records."""
    digest = _digest(key)
    others, mine = _other_machines(path, digest)
    entry = {"value": value, "measured_at": measured_at}
    if others_busy is not None:
        entry["others_busy"] = round(others_busy, 2)
    choices = {**_checked_record(mine, key), name: entry}
    _dump(path, {**others, digest: {"key": dict(key), "choices": choices}})


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Held while one process measures and stores a choice, so that processes starting together (replicas) measure
    once between them and the rest load it: measuring apart, they could decide apart. Best effort: where no lock
    can be had (no fcntl, a read-only directory, something planted at the lock's path), it runs unlocked, and
    after LOCK_WAIT_S (a process that hangs while holding it) it goes on unlocked too."""
    descriptor = None
    with contextlib.suppress(OSError):
        if fcntl is None:
            raise OSError("no fcntl here")
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path.with_name(path.name + ".lock"),
                             os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK, 0o600)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
    try:
        yield
    finally:
        if descriptor is not None:
            os.close(descriptor)  # releases the lock


def _loaded(name: str, path: Path, key: Mapping[str, Any],
            decode: Callable[[Any], T]) -> Optional[tuple[T, Provenance]]:
    entry = _stored(name, path, key)
    if entry is None:
        return None
    measured_at, others_busy = entry.get("measured_at"), entry.get("others_busy")
    try:
        if not _is_finite_number(measured_at):
            raise ValueError(f"measured_at {str(measured_at)[:80]!r} is not a time")
        if others_busy is not None and not (_is_finite_number(others_busy) and others_busy >= 0):
            raise ValueError(f"others_busy {str(others_busy)[:80]!r} is not a number of cores")
        provenance = Provenance(float(measured_at), True, str(path),
                                None if others_busy is None else float(others_busy))
        return decode(entry.get("value")), provenance
    except Exception as exc:  # a hand-edited, hostile or outdated value: measured again, never trusted
        _warn(path, f"stored {name} refused ({type(exc).__name__}: {str(exc)[:200]})")
        return None


def _is_finite_number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _provisional(found: Optional[tuple[T, Provenance]]) -> bool:
    """A stored choice measured on a busy machine, found now on a quiet one: it is measured again."""
    if found is None or found[1].others_busy is None or found[1].others_busy <= BUSY_CORES:
        return False
    now = others_busy_cores()
    return now is not None and now <= BUSY_CORES


def recall(name: str, measure: Callable[[], T], encode: Callable[[T], Any],
           decode: Callable[[Any], T]) -> tuple[T, Provenance]:
    """This machine's stored choice `name` where the record holds a valid one, else `measure()`d now and stored.

    `decode` turns the stored JSON value back into the choice and raises (any exception) where it is not one, or
    names a provider that cannot run here now: the choice is then measured again and the record overwritten.
    A stored choice measured on a busy machine is measured again where this one is quiet (module docstring).
    `measure` must not recall a choice itself (it runs holding the store's lock)."""
    path, key = store_path(), machine_key()
    found = _loaded(name, path, key, decode)
    if found is not None and not _provisional(found):
        return found
    with _exclusive(path):
        # Another process may have measured it while this one waited: what it stored is as fresh as a measurement.
        again = _loaded(name, path, key, decode)
        if again is not None and (found is None or again[1].measured_at != found[1].measured_at):
            return again
        before = others_busy_cores()
        value, measured_at = measure(), time.time()
        after = others_busy_cores()
        others_busy = None if before is None or after is None else max(before, after)
        try:
            _write(path, name, encode(value), measured_at, key, others_busy)
        except OSError as exc:  # a read-only cache directory costs a measurement per process, nothing else
            warnings.warn(f"ttftc: cannot store the measured {name} in {path} ({exc.strerror or exc})",
                          RuntimeWarning, stacklevel=2)
    return value, Provenance(measured_at, False, others_busy=others_busy)


def forget() -> Path:
    """Remove this machine's record (every choice), so that the next process, or the next recall once the
    callers' caches are cleared, measures again. Returns the store's path."""
    path = store_path()
    with _exclusive(path):  # a record stored meanwhile by another process is neither lost nor brought back
        others, _ = _other_machines(path, _digest(machine_key()))
        if others:
            _dump(path, others)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return path


# -- checks every decode shares ---------------------------------------------------------------------------------

def checked_times(raw: Any, allowed: Sequence[str]) -> dict[str, float]:
    """candidate -> a finite positive time, each candidate one of `allowed`; ValueError otherwise."""
    if not isinstance(raw, dict) or not raw:
        raise ValueError("times must be a non-empty JSON object")
    times = {}
    for name, t in raw.items():
        if name not in allowed:
            raise ValueError(f"unknown candidate {str(name)[:80]!r}")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"time of {name} is not a finite positive number: {str(t)[:80]}")
        times[name] = float(t)
    return times
