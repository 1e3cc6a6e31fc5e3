"""Build an AOT artifact from a model name, and load one (rebuilding it from its recorded source on request)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from ttftc.aot.artifact import MANIFEST, ArtifactError, load_artifact, read_manifest, write_artifact
from ttftc.aot.manifest import parse_recipe
from ttftc.buckets.program import LOGITS_MODES, GraphSignature
from ttftc.cache.schema import SchemaError
from ttftc.config import Config
from ttftc.models import load_model, resolve_model


def build_artifact(model_name: str, directory: Path | str, config: Config, *, batch_sizes: Sequence[int] = (1,),
                   logits: Sequence[str] = ("last",), kv: bool = True, attn: str = "sdpa", cache=None) -> Path:
    """Load `model_name` (a zoo preset or a local Hugging Face directory), compile every bucket x batch x logits
    mode with `config`, and write the artifact. `cache` is a CompileCache to reuse graphs from, or None."""
    from ttftc.buckets.compiled import CompiledGraphs

    for mode in logits:
        if mode not in LOGITS_MODES:
            raise ArtifactError(f"unknown logits mode {mode!r}; valid: {', '.join(LOGITS_MODES)}")
    spec = resolve_model(model_name)
    model = load_model(spec, attn=attn)
    source = CompiledGraphs(model, config, cache=cache)
    signatures = [GraphSignature(bucket, batch, mode, kv)
                  for bucket in source.plan.buckets for batch in batch_sizes for mode in logits]
    recorded = {"model": spec.name, "attn": attn, "batch_sizes": list(batch_sizes), "logits": list(logits), "kv": kv}
    return write_artifact(directory, source, signatures, model_source=recorded)


def rebuild_artifact(directory: Path | str, *, model_name: Optional[str] = None, cache=None) -> Path:
    """Build the artifact at `directory` again from the source model and options its manifest records.

    The recorded model name is trusted as far as `ttftc compile` trusts its MODEL argument: a preset, or a local
    Hugging Face directory read as data (no remote code). Pass `model_name` to use another source.
    """
    try:
        recipe = parse_recipe(read_manifest(directory), model_name)
    except SchemaError as exc:
        raise ArtifactError(f"{Path(directory) / MANIFEST} does not record how to rebuild it ({exc}); "
                            f"run `ttftc compile MODEL ... -o {directory}`") from None
    return build_artifact(recipe.model, directory, recipe.config, batch_sizes=recipe.batch_sizes,
                          logits=recipe.logits, kv=recipe.kv, attn=recipe.attn, cache=cache)


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
    rebuild_artifact(directory)
    return load_artifact(directory, device=device, verify=verify)
