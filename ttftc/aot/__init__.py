"""Ahead-of-time compilation: `ttftc compile MODEL -o DIR` writes an artifact, `ttftc.load(DIR)` serves it.

The names below resolve on first use: loading an artifact (load.py) must not import what building one needs (the
compiler, the model loaders, transformers), and importing any module of this package runs this file first.
"""

from ttftc._lazy import lazy_exports

_LAZY = {
    "ArtifactError": "ttftc.aot.artifact",
    "load_artifact": "ttftc.aot.artifact",
    "read_manifest": "ttftc.aot.artifact",
    "write_artifact": "ttftc.aot.artifact",
    "build_artifact": "ttftc.aot.build",
    "rebuild_artifact": "ttftc.aot.build",
    "load": "ttftc.aot.load",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
