"""Which model is benchmarked, and the prefill call every variant is timed on.

A model is named by a preset of `ttftc.zoo.PRESETS` (random weights, seed 0, nothing downloads) or by a local
Hugging Face model directory (config.json plus weights, loaded with `local_files_only=True`).

The prefill is what a server runs for the first token: one forward over the whole prompt, batch 1, keeping the
KV cache for the decode that follows, and computing logits for the last position only (`logits_to_keep=1`, so
the lm_head costs one token, not the whole prompt). The caller runs it under `torch.inference_mode()`.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ttftc import zoo
from ttftc.bench.errors import BenchInputError

# Keyword arguments of the timed forward; `explain` uses the same ones so it describes the same graph.
PREFILL_KWARGS: dict[str, Any] = {"logits_to_keep": 1, "use_cache": True}

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def prefill(model, ids: torch.Tensor):
    """The first-token forward (see the module docstring)."""
    return model(input_ids=ids, **PREFILL_KWARGS)


@dataclass(frozen=True)
class ModelSpec:
    """A validated model reference: a preset name, or the absolute path of a model directory."""

    name: str
    directory: Optional[str] = None  # None for a preset

    @property
    def is_preset(self) -> bool:
        return self.directory is None


def resolve_model(arg: str) -> ModelSpec:
    """Check that `arg` names a preset or a loadable causal-LM directory; raise BenchInputError otherwise."""
    if arg in zoo.PRESETS:
        return ModelSpec(name=arg)
    path = Path(arg).expanduser()
    if not path.exists():
        if os.sep in arg or arg.startswith("."):
            raise BenchInputError(f"model directory {arg!r} does not exist")
        raise BenchInputError(
            f"unknown preset {arg!r}; presets: {', '.join(sorted(zoo.PRESETS))}, or give a local model directory"
        )
    if not path.is_dir():
        raise BenchInputError(f"{arg!r} is a file, not a model directory (expected config.json and weights)")
    if not (path / "config.json").is_file():
        raise BenchInputError(f"{arg!r} is not a model directory: it has no config.json")
    if not any((path / f).is_file() for f in _WEIGHT_FILES):
        raise BenchInputError(f"{arg!r} is not a model directory: it has no model.safetensors or pytorch_model.bin")
    config = _load_config(path)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise BenchInputError(f"{arg!r} holds a {config.model_type!r} model, which is not a causal language model")
    return ModelSpec(name=str(path.resolve()), directory=str(path.resolve()))


def _load_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # a malformed config.json or an unknown model_type
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BenchInputError(f"{str(path)!r} is not a loadable model directory: {reason}") from None


def load_model(spec: ModelSpec, *, attn: str = "sdpa", device: str = "cpu") -> torch.nn.Module:
    """The fp32 model in eval mode: the preset built from its config, or the directory's weights."""
    if spec.is_preset:
        model = zoo.build_preset(spec.name, attn)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            spec.directory, attn_implementation=attn, dtype=torch.float32, local_files_only=True
        )
    return model.to(device).eval()


class ModelSource:
    """Loads the model once and hands out independent module objects for the variants.

    Each variant gets its own module (its own config, buffers and, after quantization, its own weights), so
    one variant changing its attention implementation or quantizing in place cannot affect another. Modules
    of the loaded dtype share the loaded parameters, so eight variants do not cost eight copies of the weights.
    """

    def __init__(self, spec: ModelSpec, device: str = "cpu"):
        self.spec = spec
        self.device = device
        self._base: Optional[torch.nn.Module] = None

    @property
    def base(self) -> torch.nn.Module:
        if self._base is None:
            self._base = load_model(self.spec, device=self.device)
        return self._base

    @property
    def config(self):
        return self.base.config

    def instance(self, *, attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        base = self.base
        memo: dict[int, Any] = {}
        for p in base.parameters():
            if dtype == p.dtype or not p.is_floating_point():
                memo[id(p)] = p
            else:
                memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
        model = copy.deepcopy(base, memo)
        if dtype != torch.float32:
            model.to(dtype)  # the remaining floating buffers; parameters are converted already
        if attn != model.config._attn_implementation:
            model.set_attn_implementation(attn)
        return model.eval()

    def save(self, directory: str) -> str:
        """A directory a fresh process can load the same weights from: the model's own directory, or a save."""
        if not self.spec.is_preset:
            return self.spec.directory  # type: ignore[return-value]
        from transformers.utils import logging as hf_logging

        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # bench draws its own bar
        try:
            self.base.save_pretrained(directory)
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
        return directory

    def free(self) -> None:
        self._base = None


def example_prompt(vocab_size: int, length: int, *, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """A (1, length) prompt of random token ids, fixed by `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=g).to(device)


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
