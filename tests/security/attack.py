"""What an attacker does to an artifact or a cache: edit its JSON, then recompute every checksum the manifest keeps.

Every hostile-input test goes through `forge`, so a test that passes shows that ttftc refuses the content itself, not
merely a checksum mismatch. `Outside` is the attacker's target: files beside the artifact that a successful attack
would create (a marker) or destroy (a victim); tests assert that neither happened.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from ttftc.cache.checksums import CHUNK_BYTES

MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_artifact(source: Path, target: Path) -> Path:
    """A private copy to attack; the (unchanged) weights are hard-linked, not copied."""
    shutil.copytree(source, target, copy_function=_link_weights)
    return target


def _link_weights(src: str, dst: str) -> None:
    if src.endswith(WEIGHTS):
        os.link(src, dst)
    else:
        shutil.copy2(src, dst)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data))


def resign(directory: Path) -> None:
    """Recompute the manifest's checksums for whatever the listed files now hold, as an attacker would.

    Works on a manifest the attack has already mangled: anything that is not a name -> digest table is left alone.
    """
    manifest_path = directory / MANIFEST
    manifest = read_json(manifest_path)
    if not isinstance(manifest, dict):
        return
    files = manifest.get("files")
    if isinstance(files, dict):
        for name in list(files):
            try:
                if (directory / name).is_file() and not (directory / name).is_symlink():
                    files[name] = sha256(directory / name)
            except (OSError, ValueError):  # a name the attack made unusable as a path (too long, NUL)
                continue
    chunks = manifest.get("chunks")
    weights = directory / WEIGHTS
    if isinstance(chunks, dict) and isinstance(chunks.get(WEIGHTS), dict) and weights.is_file():
        data = weights.read_bytes()
        chunks[WEIGHTS]["sha256"] = [hashlib.sha256(data[i:i + CHUNK_BYTES]).hexdigest()
                                     for i in range(0, len(data), CHUNK_BYTES)]
    write_json(manifest_path, manifest)


def forge(directory: Path, name: str, mutate: Callable[[Any], Any], *, replace: bool = False,
          sign: bool = True) -> None:
    """Apply `mutate` to the JSON file `name` of the artifact, then recompute the checksums (unless sign=False: the
    mutation is to the checksums themselves). `mutate` edits the document in place, or with replace=True returns
    the document to write instead."""
    path = directory / name
    data = read_json(path)
    result = mutate(data)
    write_json(path, result if replace else data)
    if sign:
        resign(directory)


def graph_names(directory: Path) -> list[str]:
    return sorted(f"graphs/{p.name}" for p in (directory / "graphs").glob("*.json"))


def first_node(graph: dict, target: dict) -> dict:
    """The first call node of `graph` whose target entry is `target`."""
    return next(n for n in graph["nodes"] if n.get("target") == target)


class Outside:
    """A directory beside the artifact: a marker an attack would create, victims an attack would delete."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.marker = root / "pwned"
        self.victims = [root / "victim.safetensors", root / "victim.json", root / "keep.txt"]
        for victim in self.victims:
            victim.write_bytes(b"victim data, not a tensor")
        self._before = self._snapshot()

    def _snapshot(self) -> dict[str, str]:
        return {str(p.relative_to(self.root)): sha256(p) for p in sorted(self.root.rglob("*")) if p.is_file()}

    @property
    def shell_payload(self) -> str:
        return f"touch {self.marker}"

    @property
    def python_payload(self) -> str:
        return f"__import__('os').system('touch {self.marker}')"

    def assert_untouched(self) -> None:
        assert not self.marker.exists(), "the attack ran code: the marker file was created"
        assert self._snapshot() == self._before, "a file outside the artifact was created, changed or deleted"
