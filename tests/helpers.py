"""Assertions shared across test files."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ttftc
from ttftc import zoo

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# Per-dtype tolerances for comparing kernels against their fp32 reference (atol, rtol).
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_logits_match(actual: torch.Tensor, expected: torch.Tensor, *, rel: float = 1e-4) -> None:
    """The foundation's contract: max |diff| <= rel * max(1, max |expected|)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), "non-finite logits"
    bound = rel * max(1.0, expected.abs().max().item())
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= bound, f"max |diff| {diff:.3g} exceeds {bound:.3g}"


def compile_and_run(model, ids: torch.Tensor, config: ttftc.Config | None = None):
    """(compiled logits, eager logits, report) for one prompt, both under no_grad."""
    backend = ttftc.backend(config)
    with torch.no_grad():
        expected = model(ids).logits
        actual = torch.compile(model, backend=backend)(ids).logits
    return actual, expected, backend.report()


def zoo_cases(families=zoo.CORE_FAMILIES):
    """(family, attn) pairs for parametrisation: every family with every attention implementation it supports."""
    return [(f, a) for f in families for a in zoo.FAMILIES[f].attention_impls]
