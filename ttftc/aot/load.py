"""Load an AOT artifact: the serving path, which imports neither the compiler nor the model loaders."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ttftc.aot.artifact import ArtifactError, load_artifact


def load(directory: Path | str, *, device: Optional[str] = None, verify: bool = True, rebuild: bool = False):
    """Load an AOT artifact written by `ttftc compile`: a callable model that compiles nothing.

    Versions, the device and every file's sha256 are checked first; a problem raises ArtifactError naming the
    file and the remedy. With rebuild=True, such a problem instead rebuilds the artifact from the source model
    its manifest records (which must be at hand), then loads it.
    """
    try:
        return load_artifact(directory, device=device, verify=verify)
    except ArtifactError:
        if not rebuild:
            raise
    from ttftc.aot.build import rebuild_artifact  # lazy: a rebuild loads the source model; serving never does

    rebuild_artifact(directory)
    return load_artifact(directory, device=device, verify=verify)
