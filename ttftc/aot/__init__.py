"""Ahead-of-time compilation: `ttftc compile MODEL -o DIR` writes an artifact, `ttftc.load(DIR)` serves it."""

from ttftc.aot.artifact import ArtifactError, load_artifact, read_manifest, write_artifact
from ttftc.aot.build import build_artifact, load, rebuild_artifact

__all__ = ["ArtifactError", "build_artifact", "load", "load_artifact", "read_manifest", "rebuild_artifact",
           "write_artifact"]
