"""The AOT artifact: a directory holding every bucket graph of a model, compiled offline, ready to serve.

    DIR/manifest.json          versions, device, config and its hash, pass uuids, bucket table, signatures,
                               the bucketing plan, tuned kernel configs, the source model, per-file sha256
    DIR/weights.safetensors    the transformed constants (merged, transposed, quantised weights), each once
    DIR/graphs/<signature>.json  one graph per signature, after passes and lowering (cache/graph_format.py)

`load_artifact` checks the manifest's schema (manifest.py) and versions, reads the weights into memory once and
hashes those bytes (weights.py: the loaded model never maps the file), then reads, hashes and checks every graph
(graph_format.py: allow-listed targets, identifier names) before it returns a BucketedModel whose graphs are built
from that data on first use: no Dynamo, no passes, no lowering, in the loading process. The artifact is untrusted
data: no code runs from it, and no name in it leads outside its directory (ttftc/confined.py). Every failure is an
ArtifactError naming the file and the remedy, raised by `load_artifact`, never at the first call.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import safetensors.torch
import torch

from ttftc.aot.manifest import (ARTIFACT_FORMAT, GRAPHS, MANIFEST, MAX_MANIFEST_BYTES, WEIGHTS, Manifest, graph_file,
                                parse_manifest)
from ttftc.aot.weights import read_file, tensors_in
from ttftc.bucketed import BucketedModel
from ttftc.buckets.program import GraphProgram, GraphSignature
from ttftc.buckets.plan import BucketPlan
from ttftc.cache.atomic import write_json
from ttftc.cache.checksums import CHUNK_BYTES, chunk_digests, first_bad_chunk, sha256_file
from ttftc.confined import UnsafePathError, confined_path, read_regular, regular_file
from ttftc.cache.graph_format import MAX_GRAPH_BYTES, ProgramSpec, encode_program, parse_program
from ttftc.cache.keys import device_description
from ttftc.source_hash import runtime_source_hash, versions
from ttftc.codegen.cpu._allocator import keep_freed_pages
from ttftc.cache.schema import SchemaError
from ttftc.config import Config
from ttftc.passes.manager import PassManager

__all__ = ["ARTIFACT_FORMAT", "ArtifactError", "GRAPHS", "MANIFEST", "WEIGHTS", "load_artifact", "read_manifest",
           "write_artifact"]
# Versions that must match for the saved graphs to mean the same thing. transformers is recorded only: the
# graphs do not use it at run time.
_CHECKED_VERSIONS = ("ttftc", "torch", "triton")


class ArtifactError(RuntimeError):
    """An artifact cannot be written or loaded; the message names the file and what to do."""


def _remedy(directory: Path, raw: Any) -> str:
    """What to do about a broken artifact; `raw` is the manifest as read (any JSON, or None)."""
    source = raw.get("source") if isinstance(raw, dict) else None
    model = source.get("model") if isinstance(source, dict) else None
    if isinstance(model, str) and model:
        return (f"rebuild it with `ttftc compile --rebuild -o {directory}` (source model {model[:200]!r}) "
                "or ttftc.load(..., rebuild=True)")
    return f"re-run `ttftc compile MODEL ... -o {directory}` with the source model"


# -- writing ------------------------------------------------------------------------------------------------
def _tuned_configs(programs: Sequence[GraphProgram]) -> list[dict]:
    """The kernel configs the autotuner baked into the lowered graphs (node kwarg `tuning_config`)."""
    seen = {}
    for program in programs:
        for node in program.gm.graph.nodes:
            config = node.kwargs.get("tuning_config") if node.op == "call_function" else None
            if config:
                name = getattr(node.target, "__qualname__", str(node.target))
                seen[(name, json.dumps(config, sort_keys=True, default=str))] = {"kernel": name, "config": config}
    return list(seen.values())


def write_artifact(directory: Path | str, source, signatures: Sequence[GraphSignature], *,
                   model_source: Optional[dict] = None) -> Path:
    """Compile (or fetch from `source`, a CompiledGraphs) every signature and write the artifact directory.

    The directory is assembled under a temporary name and renamed into place, so a reader never sees half an
    artifact; an existing artifact at `directory` is replaced.
    """
    directory = Path(directory)
    signatures = list(dict.fromkeys(signatures))  # each graph once: the manifest lists every signature once
    plan: BucketPlan = source.plan
    if not plan.safe:
        raise ArtifactError(f"cannot build an artifact for this model: {plan.reason}")
    if source.vocab_size is None:
        raise ArtifactError("cannot build an artifact for this model: its vocabulary size is unknown (no token "
                            "embedding and no config.vocab_size), so loaded artifacts could not check token ids")
    missing = sorted({s.bucket for s in signatures} - set(plan.buckets))
    if missing:
        raise ArtifactError(f"buckets {missing} are not in the model's bucket table {list(plan.buckets)}")
    programs = [source.get(s) for s in signatures]

    keys: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}

    def constant_key(t: torch.Tensor) -> str:
        # Constants are pooled across buckets (ConstantPool), so identity is content here.
        if id(t) not in keys:
            keys[id(t)] = f"c{len(keys)}"
            tensors[keys[id(t)]] = t.detach().contiguous().cpu()
        return keys[id(t)]

    encoded = {p.signature.name: encode_program(p, constant_key, source.device.type) for p in programs}
    staging = directory.parent / f".{directory.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / GRAPHS).mkdir(parents=True)
    try:
        safetensors.torch.save_file(tensors, str(staging / WEIGHTS))
        files = {WEIGHTS: sha256_file(staging / WEIGHTS)}
        chunks = {WEIGHTS: {"bytes": CHUNK_BYTES, "sha256": chunk_digests(staging / WEIGHTS)}}
        for signature in signatures:
            rel = graph_file(signature)
            write_json(staging / rel, encoded[signature.name])
            files[rel] = sha256_file(staging / rel)
        config: Config = source.config
        manager = PassManager(config)
        manifest = {
            "format": ARTIFACT_FORMAT,
            "versions": versions(),
            "runtime_source": runtime_source_hash(),
            "device": device_description(source.device),
            "device_type": source.device.type,
            "config": config.to_dict(),
            "config_digest": config.digest(),
            "pass_uuids": {p.name: p.uuid() for p in manager.passes},
            "passes_uuid": manager.uuid(),
            "buckets": list(plan.buckets),
            "signatures": [s.to_dict() for s in signatures],
            "plan": plan.to_dict(),
            "max_positions": source.max_positions,
            "vocab_size": source.vocab_size,
            "takes_positions": source.takes_positions,
            "tuned_kernels": _tuned_configs(programs),
            "source": model_source or {},
            "created": time.time(),
            "files": files,
            "chunks": chunks,
        }
        write_json(staging / MANIFEST, manifest)
        _swap_into_place(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _swap_into_place(staging: Path, directory: Path) -> None:
    if not directory.exists():
        os.replace(staging, directory)
        return
    if directory.is_dir() and any(directory.iterdir()) and not (directory / MANIFEST).exists():
        raise ArtifactError(f"{directory} exists and is not a ttftc artifact; refusing to replace it")
    retired = directory.parent / f".{directory.name}.old-{os.getpid()}"
    os.replace(directory, retired)
    os.replace(staging, directory)
    shutil.rmtree(retired, ignore_errors=True)


# -- reading ------------------------------------------------------------------------------------------------
def read_manifest(directory: Path | str) -> dict:
    """The manifest as JSON (a dict, schema not yet checked: see `load_manifest`)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(
            f"{directory} is not a directory; build an artifact with `ttftc compile MODEL -o {directory}`")
    path = directory / MANIFEST
    try:
        manifest = json.loads(read_regular(path, limit=MAX_MANIFEST_BYTES))
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing: {directory} is not a complete ttftc artifact; "
                            f"re-run `ttftc compile MODEL ... -o {directory}`") from None
    except (ValueError, RecursionError, OSError) as exc:  # UnicodeDecodeError, UnsafePathError are ValueErrors
        raise ArtifactError(f"{path} is corrupt ({exc}); re-run `ttftc compile MODEL ... -o {directory}`") from None
    return manifest


def load_manifest(directory: Path, raw: dict) -> Manifest:
    """The typed manifest; a missing or mistyped field is an ArtifactError naming it."""
    try:
        return parse_manifest(raw)
    except SchemaError as exc:
        raise ArtifactError(f"{directory / MANIFEST}: {exc}: {_remedy(directory, raw)}") from None


def check_manifest(directory: Path, manifest: Manifest, raw: dict, device: torch.device) -> None:
    """The artifact was built for what this process runs: versions, runtime code, device type."""
    remedy = _remedy(directory, raw)
    running = versions()
    for name in _CHECKED_VERSIONS:
        if manifest.versions.get(name) != running.get(name):
            raise ArtifactError(
                f"{directory / MANIFEST}: built with {name} {manifest.versions.get(name)}, this process has {name} "
                f"{running.get(name)}; the compiled graphs are tied to the versions that built them: {remedy}"
            )
    if manifest.runtime_source != runtime_source_hash():
        raise ArtifactError(
            f"{directory / MANIFEST}: built by a ttftc whose ops or lowerings differ from this one (runtime source "
            f"hash {manifest.runtime_source}, running {runtime_source_hash()}): {remedy}"
        )
    if manifest.device_type != device.type:
        raise ArtifactError(
            f"{directory / MANIFEST}: compiled for {manifest.device}, cannot run on {device}: {remedy}"
        )


def _artifact_file(directory: Path, rel: str, raw: dict) -> Path:
    """The file `rel` of the artifact: inside it, and a regular file (no symlink out of it)."""
    try:
        return regular_file(confined_path(directory, rel))
    except FileNotFoundError:
        raise ArtifactError(f"{directory / rel} is missing from the artifact: {_remedy(directory, raw)}") from None
    except UnsafePathError as exc:
        raise ArtifactError(f"{directory / rel} is refused ({exc}): {_remedy(directory, raw)}") from None


def verify_weights(directory: Path, manifest: Manifest, raw: dict, data: torch.Tensor) -> None:
    """`data`, the bytes read from the weights file, has the file's recorded sha256 (per chunk where recorded, hashed
    in parallel)."""
    path = directory / WEIGHTS
    view = memoryview(data.numpy())
    chunks = manifest.chunks.get(WEIGHTS)
    if chunks is not None:
        bad = first_bad_chunk(view, list(chunks.sha256), chunks.size)
        if bad is not None:
            raise ArtifactError(f"{path} is corrupt (sha256 of bytes from {bad * chunks.size} on does not match the "
                                f"manifest): {_remedy(directory, raw)}")
    elif hashlib.sha256(view).hexdigest() != manifest.files[WEIGHTS]:
        raise ArtifactError(f"{path} is corrupt (its sha256 does not match the manifest): {_remedy(directory, raw)}")


def read_weights(directory: Path, manifest: Manifest, raw: dict, device: torch.device,
                 verify: bool) -> dict[str, torch.Tensor]:
    """The artifact's constants, read into process memory once and, with `verify`, checked on those same bytes.

    The tensors view the bytes that were hashed, and never a map of the file: truncating or rewriting the file after
    the load (a `cp` of another artifact over it) can neither kill the next forward with SIGBUS nor change the
    weights it serves."""
    path = _artifact_file(directory, WEIGHTS, raw)
    chunks = manifest.chunks.get(WEIGHTS)
    limit = chunks.size * len(chunks.sha256) if verify and chunks is not None else None  # refused before it is read
    try:
        data = read_file(path, limit=limit)
    except (ValueError, RuntimeError) as exc:  # not a regular file, longer than recorded, shrank, no memory for it
        raise ArtifactError(f"{path} cannot be read ({exc}): {_remedy(directory, raw)}") from None
    if verify:
        verify_weights(directory, manifest, raw, data)
    try:
        return tensors_in(data, device)
    except (ValueError, RuntimeError) as exc:
        raise ArtifactError(f"{path} cannot be read ({type(exc).__name__}: {exc}): "
                            f"{_remedy(directory, raw)}") from None


def read_graph(directory: Path, manifest: Manifest, raw: dict, signature: GraphSignature,
               constants: dict[str, torch.Tensor]) -> ProgramSpec:
    """One graph file, hashed as it is read (the bytes checked are the bytes parsed) and checked completely."""
    rel = graph_file(signature)
    path = _artifact_file(directory, rel, raw)
    remedy = _remedy(directory, raw)
    try:
        data = read_regular(path, limit=MAX_GRAPH_BYTES)
    except UnsafePathError as exc:  # replaced since _artifact_file looked (a FIFO, a directory), or too large
        raise ArtifactError(f"{path} is refused ({exc}): {remedy}") from None
    if hashlib.sha256(data).hexdigest() != manifest.files[rel]:
        raise ArtifactError(f"{path} is corrupt (its sha256 does not match the manifest): {remedy}")
    try:
        spec = parse_program(json.loads(data), constants.__getitem__, manifest.device_type, manifest.vocab_size)
    except (ValueError, RecursionError) as exc:  # GraphFormatError, JSON and Unicode errors are ValueErrors
        raise ArtifactError(f"{path} cannot be read ({type(exc).__name__}: {exc}): {remedy}") from None
    if spec.signature != signature:
        raise ArtifactError(f"{path} holds the graph of {spec.signature}, not {signature}: {remedy}")
    return spec


class ArtifactGraphs:
    """GraphSource over an artifact: every graph is read and checked at load, and built on first use; it never
    compiles."""

    def __init__(self, directory: Path, manifest: Manifest, raw: dict, specs: dict[GraphSignature, ProgramSpec],
                 device: torch.device):
        self.directory = directory
        self.manifest = manifest
        self.raw_manifest = raw
        self.device = device
        self.plan = manifest.plan
        self.max_positions = manifest.max_positions
        self.vocab_size = manifest.vocab_size
        self.takes_positions = manifest.takes_positions
        self.specs = specs
        self.programs: dict[GraphSignature, GraphProgram] = {}
        self._lock = threading.Lock()  # two threads on the same cold graph build it once

    def get(self, signature: GraphSignature) -> GraphProgram:
        program = self.programs.get(signature)
        if program is not None:
            return program
        spec = self.specs.get(signature)
        if spec is None:
            raise self._missing(signature)
        with self._lock:
            program = self.programs.get(signature)
            if program is None:
                program = self.programs[signature] = spec.build()
        return program

    def _missing(self, signature: GraphSignature) -> ArtifactError:
        held = ", ".join(s.name for s in sorted(self.specs))
        options = {f"--logits {signature.logits}": signature.logits not in {s.logits for s in self.specs},
                   f"--batch {signature.batch}": signature.batch not in {s.batch for s in self.specs},
                   "without --no-kv": signature.kv and not any(s.kv for s in self.specs),
                   "--no-kv": not signature.kv and all(s.kv for s in self.specs)}
        needed = " ".join(flag for flag, missing in options.items() if missing) or "--buckets ..."
        return ArtifactError(
            f"artifact {self.directory} has no graph for bucket {signature.bucket} with batch {signature.batch}, "
            f"logits={signature.logits!r}, kv={signature.kv} (file {graph_file(signature)}); it holds "
            f"{held}. Rebuild it with `ttftc compile MODEL {needed} -o {self.directory}`"
        )

    def dynamic(self, logits: str, kv: bool) -> None:
        return None  # an artifact holds fixed shapes only; the model that could be traced is not here


def load_artifact(directory: Path | str, *, device: Optional[str] = None, verify: bool = True):
    """A BucketedModel serving from the artifact at `directory`; see the module docstring.

    verify=False skips hashing the weights (the slow part); graph files are always hashed as they are read.
    """
    directory = Path(directory)
    raw = read_manifest(directory)
    manifest = load_manifest(directory, raw)
    try:
        target = torch.device(device or manifest.device_type)
    except (RuntimeError, ValueError) as exc:
        raise ArtifactError(f"{directory / MANIFEST}: device {device or manifest.device_type!r} is not a torch "
                            f"device ({exc}): {_remedy(directory, raw)}") from None
    check_manifest(directory, manifest, raw, target)
    try:
        constants = read_weights(directory, manifest, raw, target, verify)
        specs = {s: read_graph(directory, manifest, raw, s, constants) for s in manifest.signatures}
    except OSError as exc:  # unreadable (permissions, I/O): the same remedy as a damaged file
        raise ArtifactError(f"{directory} cannot be read ({exc}): {_remedy(directory, raw)}") from None
    graphs = ArtifactGraphs(directory, manifest, raw, specs, target)
    if target.type == "cpu":
        keep_freed_pages()  # what a compile on the CPU does too (ttftc/pipeline.py)
    return BucketedModel(graphs, device=target, on_oversize=manifest.on_oversize)
