"""The shapes tests/gpu runs at: real model shapes on a GPU, tiny ones in the CPU dry run.

llama-135m and smol-135m are read from ttftc.zoo.PRESETS so the two cannot drift; the 1B shape (a Llama 3.2 1B
layout: hidden 2048, 16 layers, 32/8 heads, head dim 64, intermediate 8192, vocab 128256) has no preset.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

import torch

DRY_RUN_ENV = "TTFTC_GPU_DRY_RUN"


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int


def _preset(name: str) -> ModelShape:
    from ttftc import zoo

    cfg = zoo.PRESETS[name][1]
    heads = cfg["num_attention_heads"]
    return ModelShape(cfg["hidden_size"], heads, cfg["num_key_value_heads"], cfg["hidden_size"] // heads,
                      cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"])


ONE_B = ModelShape(hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=128256, layers=16)
TINY = ModelShape(hidden=40, heads=4, kv_heads=2, head_dim=16, intermediate=24, vocab=96, layers=1)


def dry_run() -> bool:
    return os.environ.get(DRY_RUN_ENV) == "1"


def skip_reason() -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if torch.cuda.is_available():
        return None
    if dry_run():
        if os.environ.get("TRITON_INTERPRET") != "1":
            return f"{DRY_RUN_ENV}=1 needs TRITON_INTERPRET=1 (tests/conftest.py sets it where there is no CUDA)"
        return None
    return f"needs a CUDA GPU ({DRY_RUN_ENV}=1 runs these on CPU at tiny shapes under the Triton interpreter)"


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def models() -> dict[str, ModelShape]:
    if dry_run() and not torch.cuda.is_available():
        return {"tiny": TINY}
    return {"llama-135m": _preset("llama-135m"), "smol-135m": _preset("smol-135m"), "1b": ONE_B}


def on_gpu() -> bool:
    return torch.cuda.is_available()


def tokens() -> int:
    """Rows of the GEMM, norm and quantiser checks (a 512-token prefill on a GPU)."""
    return 512 if on_gpu() else 7


def attention_tokens() -> int:
    """Query and key length of the attention checks: long enough for many key blocks per query block."""
    return 2048 if on_gpu() else 9


def head_dims() -> tuple[int, ...]:
    """Head dims beyond the models' 64: the padded (80, 96) and largest tiles (256) included."""
    return (32, 64, 80, 96, 128, 256) if on_gpu() else (16, 24)
