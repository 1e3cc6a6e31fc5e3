"""The artifact manifest's schema: every field a loader uses, checked for its type in one place (the fields only a
rebuild reads, the recorded source, are parsed with the rebuild, in build.py).

A manifest is untrusted input: anyone who can write the artifact directory can rewrite it and recompute its
checksums. `parse_manifest` turns the JSON object into a typed `Manifest` or raises SchemaError naming the first
bad field (artifact.py adds the file and the remedy and raises ArtifactError). The set of files is derived, not
trusted: exactly the weights plus one graph per signature, so the `files` table can neither add a file nor leave
a graph out, and no name in it reaches the filesystem unchecked.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from ttftc.buckets.plan import BucketPlan
from ttftc.buckets.program import GraphSignature
from ttftc.cache.schema import (
    SHA256_HEX, SchemaError, as_bool, as_buckets, as_dict, as_int, as_list, as_str, field, optional, plan_from_json,
)
from ttftc.config import OVERSIZE_POLICIES

ARTIFACT_FORMAT = 2  # 2: vocab_size recorded; the file set is exactly weights + one graph per signature
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
GRAPHS = "graphs"
# The largest manifest read (checked before reading). It grows with the signatures and with one chunk digest per
# 64 MiB of weights; a file far larger is not a manifest written here.
MAX_MANIFEST_BYTES = 4 << 20


def graph_file(signature: GraphSignature) -> str:
    return f"{GRAPHS}/{signature.name}.json"


class ChunkDigests(NamedTuple):
    """sha256 of each `size`-byte chunk of a file, in order."""

    size: int
    sha256: tuple[str, ...]


class Manifest(NamedTuple):
    """The typed manifest (a NamedTuple, not a dataclass: it is defined on every artifact load's import path)."""

    format: int
    versions: dict[str, Optional[str]]
    runtime_source: str
    device: str
    device_type: str
    buckets: tuple[int, ...]
    signatures: tuple[GraphSignature, ...]
    plan: BucketPlan
    max_positions: Optional[int]
    vocab_size: int
    takes_positions: bool
    on_oversize: str
    files: dict[str, str]  # relative name -> sha256 hex, exactly WEIGHTS and graph_file(s) for every signature
    chunks: dict[str, ChunkDigests]


def _signature(value: Any, where: str) -> GraphSignature:
    try:
        return GraphSignature.from_dict(value)
    except ValueError as exc:
        raise SchemaError(f"field {where!r}: {exc}") from None


def _sha256(value: Any, where: str) -> str:
    return as_str(value, where, pattern=SHA256_HEX)


def _versions(value: Any, where: str) -> dict[str, Optional[str]]:
    return {as_str(k, f"{where} key"): optional(as_str)(v, f"{where}.{k}") for k, v in as_dict(value, where).items()}


def _chunks(value: Any, where: str) -> dict[str, ChunkDigests]:
    chunks = {}
    for name, entry in as_dict(value, where).items():
        if name != WEIGHTS:
            raise SchemaError(f"field {where!r}: only {WEIGHTS} is checked in chunks, not {name!r}"[:200])
        at = f"{where}.{name}"
        chunks[name] = ChunkDigests(as_int(field(entry, "bytes", at), f"{at}.bytes", minimum=1),
                                    tuple(as_list(field(entry, "sha256", at), f"{at}.sha256", _sha256)))
    return chunks


def parse_manifest(raw: Any) -> Manifest:
    """The typed manifest; SchemaError names the first field that is missing or has the wrong type or value.

    The format comes first, so an artifact from another ttftc release says so instead of failing on a field.
    """
    if not isinstance(raw, dict):
        raise SchemaError(f"the manifest must be a JSON object, got {type(raw).__name__}")
    version = field(raw, "format", "")
    if version != ARTIFACT_FORMAT:
        raise SchemaError(f"artifact format {version!r}; this ttftc reads format {ARTIFACT_FORMAT}"[:200])
    buckets = as_buckets(field(raw, "buckets", ""), "buckets")
    signatures = tuple(as_list(field(raw, "signatures", ""), "signatures", _signature))
    if not signatures or len(set(signatures)) != len(signatures):
        raise SchemaError("field 'signatures' must list at least one graph signature, each once")
    outside = sorted({s.bucket for s in signatures} - set(buckets))
    if outside:
        raise SchemaError(f"field 'signatures': buckets {outside} are not in the bucket table {list(buckets)}")
    plan = plan_from_json(field(raw, "plan", ""), "plan")
    if plan.buckets != buckets:
        raise SchemaError(f"field 'plan.buckets' {list(plan.buckets)} differs from 'buckets' {list(buckets)}")
    files = {as_str(k, "files key"): _sha256(v, f"files.{k}") for k, v in as_dict(field(raw, "files", ""), "files").items()}
    expected = {WEIGHTS} | {graph_file(s) for s in signatures}
    if set(files) != expected:
        extra, missing = sorted(set(files) - expected), sorted(expected - set(files))
        raise SchemaError(f"field 'files' must list exactly the weights and one graph per signature: "
                          f"unexpected {extra}, missing {missing}"[:300])
    config = as_dict(field(raw, "config", ""), "config")
    return Manifest(
        format=version,
        versions=_versions(field(raw, "versions", ""), "versions"),
        runtime_source=as_str(field(raw, "runtime_source", ""), "runtime_source"),
        device=as_str(field(raw, "device", ""), "device"),
        device_type=as_str(field(raw, "device_type", ""), "device_type"),
        buckets=buckets,
        signatures=signatures,
        plan=plan,
        max_positions=optional(as_int)(field(raw, "max_positions", ""), "max_positions", minimum=1),
        vocab_size=as_int(field(raw, "vocab_size", ""), "vocab_size", minimum=1),
        takes_positions=as_bool(field(raw, "takes_positions", ""), "takes_positions"),
        on_oversize=as_str(field(config, "on_oversize", "config"), "config.on_oversize", choices=OVERSIZE_POLICIES),
        files=files,
        chunks=_chunks(raw.get("chunks", {}), "chunks"),
    )
