"""Writes that readers never see half-done: write a temporary file in the same directory, then os.replace.

os.replace is atomic on POSIX and Windows within one filesystem, so a concurrent reader sees either the old
file, no file, or the whole new one. Two writers of the same entry both succeed; the last rename wins, and
since entries are keyed by content, both wrote the same thing.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yields a temporary path next to `path`; on success it is renamed over `path`, on failure removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def write_json(path: Path, payload) -> None:
    write_bytes(path, json.dumps(payload, indent=1, sort_keys=True).encode())
