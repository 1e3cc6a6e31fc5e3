"""What a build of ttftc is, as hashes and versions: its source files (all of them, or the code a compiled graph runs)
and the versions of the libraries that turn model code into graphs. The compile cache's keys, an artifact's manifest
and the Inductor pass's identity are built from these.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
from pathlib import Path
from typing import Optional

import torch

import ttftc


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Optional[str]]:
    return {
        "ttftc": ttftc.__version__,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
    }


SOURCE_SUFFIXES = (".py", ".cpp", ".h")  # the native kernels' C++ is ttftc source too


def _hash_sources(subdirs: tuple[str, ...]) -> str:
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for sub in subdirs:
        where = root / sub
        files = [p for p in where.rglob("*") if p.suffix in SOURCE_SUFFIXES] if where.is_dir() else [where]
        for path in sorted(files):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def ttftc_source_hash() -> str:
    """Hash of every ttftc source file: a changed pass, op or lowering invalidates graphs compiled before it."""
    return _hash_sources(("",))


@functools.lru_cache(maxsize=1)
def runtime_source_hash() -> str:
    """Hash of the code a compiled graph calls when it runs (the ops and their lowerings) and of the graph
    file format: what must not change under a saved artifact. Passes and capture only matter when building."""
    return _hash_sources(("ops", "codegen", "cache/graph_format.py", "cache/graph_calls.py"))
