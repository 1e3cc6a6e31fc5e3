"""Build an AOT artifact from a model name, or again from the source its manifest records.

Building loads the source model (a zoo preset or a Hugging Face directory), so this module imports the model
loaders and the compiler; loading an artifact (load.py) imports neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

from ttftc.aot.artifact import MANIFEST, ArtifactError, read_manifest, write_artifact
from ttftc.buckets.compiled import CompiledGraphs
from ttftc.buckets.program import LOGITS_MODES, GraphSignature
from ttftc.cache.schema import SchemaError, as_bool, as_dict, as_int, as_list, as_str, field
from ttftc.config import Config
from ttftc.models import load_model, resolve_model
from ttftc.zoo import ATTENTION_IMPLS


def build_artifact(model_name: str, directory: Path | str, config: Config, *, batch_sizes: Sequence[int] = (1,),
                   logits: Sequence[str] = ("last",), kv: bool = True, attn: str = "sdpa", cache=None) -> Path:
    """Load `model_name` (a zoo preset or a local Hugging Face directory), compile every bucket x batch x logits
    mode with `config`, and write the artifact. `cache` is a CompileCache to reuse graphs from, or None."""
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


class BuildRecipe(NamedTuple):
    """How the artifact was built, from its manifest: what `rebuild_artifact` repeats."""

    model: str
    config: Config
    attn: str
    batch_sizes: tuple[int, ...]
    logits: tuple[str, ...]
    kv: bool


def parse_recipe(raw: Any, model_name: Optional[str] = None) -> BuildRecipe:
    """The recorded source and Config; SchemaError names the field. `model_name` overrides the recorded model."""
    source = as_dict(field(raw, "source", ""), "source")
    model = model_name or as_str(field(source, "model", "source"), "source.model")
    fields = dict(as_dict(field(raw, "config", ""), "config"))
    for key in ("passes", "buckets", "quant_skip"):
        if isinstance(fields.get(key), list):
            fields[key] = tuple(fields[key])
    try:
        config = Config(**fields)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"field 'config' does not make a ttftc Config: {exc}"[:300]) from None
    positive = lambda v, w: as_int(v, w, minimum=1)  # noqa: E731
    mode = lambda v, w: as_str(v, w, choices=LOGITS_MODES)  # noqa: E731
    return BuildRecipe(
        model=model,
        config=config,
        attn=as_str(source.get("attn", "sdpa"), "source.attn", choices=ATTENTION_IMPLS),
        batch_sizes=tuple(as_list(source.get("batch_sizes", [1]), "source.batch_sizes", positive)),
        logits=tuple(as_list(source.get("logits", ["last"]), "source.logits", mode)),
        kv=as_bool(source.get("kv", True), "source.kv"),
    )
