"""sha256 checksums of artifact files, whole and in chunks.

The manifest keeps each file's whole sha256 (what `sha256sum` prints) and, for large files, the sha256 of
each fixed-size chunk. Chunks verify in parallel threads (hashlib releases the GIL on large buffers), so a large
weights file checks faster on several cores (benchmarks/README.md, start-up) without weakening the check: every
byte is still hashed.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

CHUNK_BYTES = 64 << 20
_READ = 4 << 20


def _hash_range(path: Path, start: int, length: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        remaining = length
        while remaining > 0:
            block = f.read(min(_READ, remaining))
            if not block:
                break
            digest.update(block)
            remaining -= len(block)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    return _hash_range(path, 0, os.path.getsize(path))


def chunk_digests(path: Path, chunk: int = CHUNK_BYTES) -> list[str]:
    size = os.path.getsize(path)
    return [_hash_range(path, start, chunk) for start in range(0, size, chunk)]


def first_bad_chunk(data: memoryview, digests: list[str], chunk: int, workers: Optional[int] = None) -> Optional[int]:
    """Index of the first chunk of `data` whose sha256 differs (len(digests) if its length is wrong), else None.

    It hashes bytes already in memory, not the file: the caller serves the bytes it checked, so a file rewritten
    between the check and the load cannot slip through."""
    size = len(data)
    if (size + chunk - 1) // chunk != len(digests):
        return len(digests)
    starts = list(range(0, size, chunk))
    with ThreadPoolExecutor(max_workers=workers or min(len(starts), os.cpu_count() or 1) or 1) as pool:
        actual = list(pool.map(lambda s: hashlib.sha256(data[s:s + chunk]).hexdigest(), starts))
    for index, (got, want) in enumerate(zip(actual, digests)):
        if got != want:
            return index
    return None
