"""Task accuracy of the checked-in tiny Llama (examples/quality/) in fp32, bf16 and int8 through ttftc."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import needs_transformers

QUALITY_DIR = Path(__file__).resolve().parents[2] / "examples" / "quality"
pytestmark = needs_transformers


def _load(name: str):
    sys.path.insert(0, str(QUALITY_DIR))
    try:
        spec = importlib.util.spec_from_file_location(f"ttftc_quality_{name}", QUALITY_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(QUALITY_DIR))


@pytest.fixture(scope="module")
def setup():
    evaluate = _load("evaluate")
    model = evaluate.load_model()
    batch = evaluate.tiny_task.eval_batch(256)
    eager_acc, eager_logits = evaluate.evaluate(model, None, batch)
    return evaluate, model, batch, eager_acc, eager_logits


def test_checked_in_weights_are_small_and_trained(setup):
    _, model, _, eager_acc, _ = setup
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    assert size <= 5_000_000
    assert eager_acc >= 95.0  # the model solves the task, so precision loss would show


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_accuracy_through_ttftc_stays_within_one_point(setup, precision):
    _check_accuracy(setup, precision)


def test_int8_accuracy_stays_within_one_point_through_every_int8_gemm(setup, each_int8_gemm):
    _check_accuracy(setup, "int8")


def _check_accuracy(setup, precision):
    evaluate, model, batch, eager_acc, eager_logits = setup
    acc, logits = evaluate.evaluate(model, precision, batch)
    cos = torch.nn.functional.cosine_similarity(logits.double().flatten(), eager_logits.double().flatten(), dim=0)
    assert abs(acc - eager_acc) <= 1.0, f"{precision}: {acc:.2f}% vs eager fp32 {eager_acc:.2f}%"
    assert cos >= 0.99
