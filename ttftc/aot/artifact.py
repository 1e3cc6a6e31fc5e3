"""The AOT artifact: a directory holding every bucket graph of a model, compiled offline, ready to serve.

    DIR/manifest.json          versions, device, config and its hash, pass uuids, bucket table, signatures,
                               the bucketing plan, tuned kernel configs, the source model, per-file sha256
    DIR/weights.safetensors    the transformed constants (merged, transposed, quantised weights), each once
    DIR/graphs/<signature>.json  one graph per signature, after passes and lowering (cache/graph_format.py)

`load_artifact` checks versions and checksums before it builds anything, then returns a BucketedModel whose
graphs are rebuilt from data: no Dynamo, no passes, no lowering, in the loading process. Every failure is an
ArtifactError naming the file and the remedy.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ttftc.buckets.program import GraphProgram, GraphSignature
from ttftc.buckets.plan import BucketPlan
from ttftc.cache.atomic import write_json
from ttftc.cache.checksums import CHUNK_BYTES, chunk_digests, first_bad_chunk, sha256_file
from ttftc.cache.graph_format import decode_program, encode_program
from ttftc.cache.keys import device_description, runtime_source_hash, versions
from ttftc.config import Config

ARTIFACT_FORMAT = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
GRAPHS = "graphs"
# Versions that must match for the saved graphs to mean the same thing. transformers is recorded only: the
# graphs do not use it at run time.
_CHECKED_VERSIONS = ("ttftc", "torch", "triton")


class ArtifactError(RuntimeError):
    """An artifact cannot be written or loaded; the message names the file and what to do."""


def _remedy(directory: Path, manifest: Optional[dict]) -> str:
    source = (manifest or {}).get("source") or {}
    if source.get("model"):
        return (f"rebuild it with `ttftc compile --rebuild -o {directory}` (source model {source['model']}) "
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
    from safetensors.torch import save_file

    directory = Path(directory)
    plan: BucketPlan = source.plan
    if not plan.safe:
        raise ArtifactError(f"cannot build an artifact for this model: {plan.reason}")
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

    encoded = {p.signature.name: encode_program(p, constant_key) for p in programs}
    staging = directory.parent / f".{directory.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / GRAPHS).mkdir(parents=True)
    try:
        save_file(tensors, str(staging / WEIGHTS))
        files = {WEIGHTS: sha256_file(staging / WEIGHTS)}
        chunks = {WEIGHTS: {"bytes": CHUNK_BYTES, "sha256": chunk_digests(staging / WEIGHTS)}}
        for name, data in encoded.items():
            rel = f"{GRAPHS}/{name}.json"
            write_json(staging / rel, data)
            files[rel] = sha256_file(staging / rel)
        config: Config = source.config
        from ttftc.passes.manager import PassManager

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
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(
            f"{directory} is not a directory; build an artifact with `ttftc compile MODEL -o {directory}`")
    if not path.exists():
        raise ArtifactError(f"{path} is missing: {directory} is not a complete ttftc artifact; "
                            f"re-run `ttftc compile MODEL ... -o {directory}`")
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict) or "files" not in manifest:
            raise ValueError("not a ttftc manifest")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is corrupt ({exc}); re-run `ttftc compile MODEL ... -o {directory}`") from None
    return manifest


def check_manifest(directory: Path, manifest: dict, device: torch.device) -> None:
    remedy = _remedy(directory, manifest)
    if manifest.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"{directory / MANIFEST} has artifact format {manifest.get('format')!r}, this ttftc "
                            f"reads format {ARTIFACT_FORMAT}: {remedy}")
    built, running = manifest.get("versions", {}), versions()
    for name in _CHECKED_VERSIONS:
        if built.get(name) != running.get(name):
            raise ArtifactError(
                f"{directory / MANIFEST}: built with {name} {built.get(name)}, this process has {name} "
                f"{running.get(name)}; the compiled graphs are tied to the versions that built them: {remedy}"
            )
    if manifest.get("runtime_source") != runtime_source_hash():
        raise ArtifactError(
            f"{directory / MANIFEST}: built by a ttftc whose ops or lowerings differ from this one (runtime source "
            f"hash {manifest.get('runtime_source')}, running {runtime_source_hash()}): {remedy}"
        )
    if manifest.get("device_type") != device.type:
        raise ArtifactError(
            f"{directory / MANIFEST}: compiled for {manifest.get('device')}, cannot run on {device}: {remedy}"
        )


def verify_files(directory: Path, manifest: dict) -> None:
    """Every file the manifest lists exists and has its recorded sha256 (per chunk where recorded)."""
    remedy = _remedy(directory, manifest)
    chunked = manifest.get("chunks", {})
    for rel, expected in manifest["files"].items():
        path = directory / rel
        if not path.is_file():
            raise ArtifactError(f"{path} is missing from the artifact: {remedy}")
        if rel in chunked:
            bad = first_bad_chunk(path, chunked[rel]["sha256"], chunked[rel]["bytes"])
            if bad is not None:
                raise ArtifactError(
                    f"{path} is corrupt (sha256 of bytes from {bad * chunked[rel]['bytes']} on does not match the "
                    f"manifest): {remedy}"
                )
        elif sha256_file(path) != expected:
            raise ArtifactError(f"{path} is corrupt (its sha256 does not match the manifest): {remedy}")


class ArtifactGraphs:
    """GraphSource over an artifact: graphs are rebuilt from their files on first use; it never compiles."""

    def __init__(self, directory: Path, manifest: dict, constants: dict[str, torch.Tensor], device: torch.device):
        self.directory = directory
        self.manifest = manifest
        self.constants = constants
        self.device = device
        self.plan = BucketPlan.from_dict(manifest["plan"])
        self.max_positions = manifest.get("max_positions")
        self.takes_positions = bool(manifest.get("takes_positions", True))
        self.signatures = {GraphSignature.from_dict(s) for s in manifest["signatures"]}
        self.programs: dict[GraphSignature, GraphProgram] = {}

    def get(self, signature: GraphSignature) -> GraphProgram:
        program = self.programs.get(signature)
        if program is not None:
            return program
        if signature not in self.signatures:
            held = ", ".join(s.name for s in sorted(self.signatures))
            options = {f"--logits {signature.logits}":
                       signature.logits not in {s.logits for s in self.signatures},
                       f"--batch {signature.batch}": signature.batch not in {s.batch for s in self.signatures},
                       "without --no-kv": signature.kv and not any(s.kv for s in self.signatures),
                       "--no-kv": not signature.kv and all(s.kv for s in self.signatures)}
            needed = " ".join(flag for flag, missing in options.items() if missing) or "--buckets ..."
            raise ArtifactError(
                f"artifact {self.directory} has no graph for bucket {signature.bucket} with batch {signature.batch}, "
                f"logits={signature.logits!r}, kv={signature.kv} (file {GRAPHS}/{signature.name}.json); it holds "
                f"{held}. Rebuild it with `ttftc compile MODEL {needed} -o {self.directory}`"
            )
        path = self.directory / GRAPHS / f"{signature.name}.json"
        try:
            program = decode_program(json.loads(path.read_text()), self.constants.__getitem__)
        except FileNotFoundError:
            remedy = _remedy(self.directory, self.manifest)
            raise ArtifactError(f"{path} is missing from the artifact: {remedy}") from None
        except Exception as exc:
            raise ArtifactError(f"{path} cannot be read ({type(exc).__name__}: {exc}): "
                                f"{_remedy(self.directory, self.manifest)}") from None
        self.programs[signature] = program
        return program

    def dynamic(self, logits: str, kv: bool) -> None:
        return None  # an artifact holds fixed shapes only; the model that could be traced is not here


def load_artifact(directory: Path | str, *, device: Optional[str] = None, verify: bool = True):
    """A BucketedModel serving from the artifact at `directory`; see the module docstring."""
    from ttftc.aot.weights import map_safetensors
    from ttftc.runtime.bucketed import BucketedModel

    directory = Path(directory)
    manifest = read_manifest(directory)
    target = torch.device(device or manifest.get("device_type", "cpu"))
    check_manifest(directory, manifest, target)
    if verify:
        verify_files(directory, manifest)
    try:
        constants = map_safetensors(directory / WEIGHTS, target)
    except Exception as exc:
        raise ArtifactError(f"{directory / WEIGHTS} cannot be read ({type(exc).__name__}: {exc}): "
                            f"{_remedy(directory, manifest)}") from None
    # The recorded Config is not rebuilt: validating it would import every pass, and serving needs only this.
    on_oversize = manifest["config"].get("on_oversize", "error")
    return BucketedModel(ArtifactGraphs(directory, manifest, constants, target), device=target, on_oversize=on_oversize)
