"""Fresh, temporary compile-cache directories, so no measured compile is served from an earlier run's cache.

Covers Inductor (TORCHINDUCTOR_CACHE_DIR: FX graph, AOTAutograd and kernel caches), Triton (TRITON_CACHE_DIR)
and ttftc (TTFTC_CACHE_DIR: autotune and compile caches). Only on-disk caches are covered: a process that
already compiled something keeps its in-memory state, which is why cold first calls run in a fresh process
(see cold_start.py).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator

CACHE_ENV_VARS = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "TTFTC_CACHE_DIR": "ttftc",
}


def cache_env(root: str) -> dict[str, str]:
    """Environment variables pointing every compile cache at its own (new, empty) directory under `root`."""
    env = {}
    for var, sub in CACHE_ENV_VARS.items():
        path = os.path.join(root, sub)
        os.makedirs(path, exist_ok=True)
        env[var] = path
    return env


@contextlib.contextmanager
def fresh_cache_dirs(prefix: str = "ttftc-bench-") -> Iterator[dict[str, str]]:
    """Point this process's compile caches at empty temporary directories; restore and delete on exit."""
    saved = {var: os.environ.get(var) for var in CACHE_ENV_VARS}
    with tempfile.TemporaryDirectory(prefix=prefix) as root:
        env = cache_env(root)
        os.environ.update(env)
        try:
            yield env
        finally:
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
