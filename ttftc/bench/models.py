"""Which model is benchmarked, and the prefill call every variant is timed on.

A model is named as everywhere in ttftc (ttftc/models.py): a preset of `ttftc.zoo.PRESETS` or a local Hugging Face
model directory.

The prefill is what a server runs for the first token: one forward over the whole prompt, batch 1, keeping the
KV cache for the decode that follows, and computing logits for the last position only (`logits_to_keep=1`, so
the lm_head costs one token, not the whole prompt). The caller runs it under `torch.inference_mode()`.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from transformers.utils import logging as hf_logging

from ttftc.models import ModelSpec, load_model, max_positions, model_config, resolve_model

__all__ = ["PREFILL_KWARGS", "ModelSource", "ModelSpec", "example_prompt", "load_model", "max_positions",
           "model_config", "prefill", "resolve_model"]

# Keyword arguments of the timed forward; `explain` uses the same ones so it describes the same graph.
PREFILL_KWARGS: dict[str, Any] = {"logits_to_keep": 1, "use_cache": True}


def prefill(model, ids: torch.Tensor):
    """The first-token forward (see the module docstring)."""
    return model(input_ids=ids, **PREFILL_KWARGS)


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


