"""A model zoo for tests and demos: Hugging Face model classes from small configs, random weights, fixed seeds.

Nothing downloads: every model is built from a config in this file. `build("llama")` gives a tiny 2-layer model;
`PRESETS` holds the benchmark-sized ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import (AutoModelForCausalLM, GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Phi3Config,
                          Qwen2Config)

ATTENTION_IMPLS = ("eager", "sdpa")

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512)


def _llama(**kw):
    return LlamaConfig(**{**_TINY, "num_attention_heads": 4, "num_key_value_heads": 4, **kw})


def _qwen2(**kw):
    # GQA 4:1 and Qwen2's q/k/v biases.
    return Qwen2Config(**{**_TINY, "num_attention_heads": 4, "num_key_value_heads": 1, **kw})


def _mistral(**kw):
    # The window is wider than any test prompt, so attention is plainly causal; a narrower window is a
    # separate test case.
    return MistralConfig(**{**_TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 4096, **kw})


def _gpt2(**kw):
    base = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=0, eos_token_id=0)
    renames = {"num_hidden_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head"}
    return GPT2Config(**{**base, **{renames.get(k, k): v for k, v in kw.items()}})


def _phi3(**kw):
    # Phi-3 ships gate and up already merged (gate_up_proj) and q/k/v merged (qkv_proj).
    return Phi3Config(**{**_TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1,
                                "eos_token_id": 2, **kw})


def _gemma(**kw):
    # GeGLU (gelu-tanh) and RMSNorm with (1 + w).
    return GemmaConfig(**{**_TINY, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, **kw})


@dataclass(frozen=True)
class Family:
    name: str
    make_config: Callable[..., object]
    attention_impls: tuple[str, ...] = ATTENTION_IMPLS


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", _llama),
        Family("qwen2", _qwen2),
        Family("mistral", _mistral),
        Family("gpt2", _gpt2),
        Family("phi3", _phi3),
        Family("gemma", _gemma),
    )
}

# The families every end-to-end test must cover (the brief's minimum).
CORE_FAMILIES = ("llama", "qwen2", "mistral", "gpt2")

# Benchmark-sized presets (design.md and the bench issue).
PRESETS: dict[str, tuple[str, dict]] = {
    "llama-135m": (
        "llama",
        dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=8192),
    ),
    "qwen2-gqa-150m": (
        "qwen2",
        dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192),
    ),
    # The shape of a real small checkpoint (SmolLM-135M: GQA 9/3, tied embeddings), random weights.
    "smol-135m": (
        "llama",
        dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=8192),
    ),
    "tiny": ("llama", dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096)),
}


def config(family: str, **overrides):
    if family not in FAMILIES:
        raise ValueError(f"Unknown model family {family!r}; known families: {sorted(FAMILIES)}")
    return FAMILIES[family].make_config(**overrides)


def build(family: str, attn: str = "eager", *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised causal LM of `family` in eval mode. `overrides` go to the HF config."""
    if attn not in ATTENTION_IMPLS:
        raise ValueError(f"Unknown attention implementation {attn!r}; valid: {ATTENTION_IMPLS}")
    cfg = config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    return model.eval()


def build_preset(name: str, attn: str = "sdpa", *, seed: int = 0, dtype: torch.dtype = torch.float32):
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    family, overrides = PRESETS[name]
    return build(family, attn, seed=seed, dtype=dtype, **overrides)


def example_ids(model, length: int = 12, batch: int = 1, *, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=g)
