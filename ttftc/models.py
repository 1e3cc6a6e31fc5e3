"""Which model a name means: a zoo preset (random weights, nothing downloads) or a local Hugging Face directory.

One resolution for every entry point that takes a model by name (`ttftc bench`, `explain`, `autotune`,
`compile`, `serve` and `ttftc.LLM`), so a name means the same model everywhere and a bad one gets the same
message. A directory is loaded with `local_files_only=True`: nothing is fetched, and its config must describe a
causal language model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ttftc import zoo

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class ModelInputError(ValueError):
    """A model name the user must fix: an unknown preset, or a directory that is not a causal-LM checkpoint."""


@dataclass(frozen=True)
class ModelSpec:
    """A validated model reference: a preset name, or the absolute path of a model directory."""

    name: str
    directory: Optional[str] = None  # None for a preset

    @property
    def is_preset(self) -> bool:
        return self.directory is None


def resolve_model(arg: str) -> ModelSpec:
    """Check that `arg` names a preset or a loadable causal-LM directory; raise ModelInputError otherwise."""
    if arg in zoo.PRESETS:
        return ModelSpec(name=arg)
    path = Path(arg).expanduser()
    if not path.exists():
        if os.sep in arg or arg.startswith("."):
            raise ModelInputError(f"model directory {arg!r} does not exist")
        raise ModelInputError(
            f"unknown preset {arg!r}; presets: {', '.join(sorted(zoo.PRESETS))}, or give a local model directory"
        )
    if not path.is_dir():
        raise ModelInputError(f"{arg!r} is a file, not a model directory (expected config.json and weights)")
    if not (path / "config.json").is_file():
        raise ModelInputError(f"{arg!r} is not a model directory: it has no config.json")
    if not any((path / f).is_file() for f in _WEIGHT_FILES):
        raise ModelInputError(f"{arg!r} is not a model directory: it has no model.safetensors or pytorch_model.bin")
    config = _load_config(path)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelInputError(f"{arg!r} holds a {config.model_type!r} model, which is not a causal language model")
    return ModelSpec(name=str(path.resolve()), directory=str(path.resolve()))


def _load_config(path: Path):
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # a malformed config.json or an unknown model_type
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelInputError(f"{str(path)!r} is not a loadable model directory: {reason}") from None


def load_model(spec: ModelSpec, *, attn: str = "sdpa", device: str = "cpu") -> torch.nn.Module:
    """The fp32 model in eval mode: the preset built from its config, or the directory's weights."""
    if spec.is_preset:
        model = zoo.build_preset(spec.name, attn)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            spec.directory, attn_implementation=attn, dtype=torch.float32, local_files_only=True
        )
    return model.to(device).eval()


def max_positions(config) -> Optional[int]:
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def model_config(spec: ModelSpec):
    """The Hugging Face config, without building the model (for validating lengths up front)."""
    if spec.is_preset:
        family, overrides = zoo.PRESETS[spec.name]
        return zoo.config(family, **overrides)
    return _load_config(Path(spec.directory))  # type: ignore[arg-type]
