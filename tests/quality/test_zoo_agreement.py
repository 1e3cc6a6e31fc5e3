"""int8 keeps the model's choices: top-1 next-token agreement with fp32 over 256 positions, per zoo family.

Random weights give flat logits, where a small perturbation flips the argmax more easily than in a trained model,
so this is a strict check of the quantisation error rather than a quality estimate (examples/quality has that).
"""

import pytest
import torch

import ttftc
from tests.helpers import needs_transformers
from ttftc import zoo

pytestmark = needs_transformers

POSITIONS = 256
MIN_AGREEMENT = 0.95


@pytest.mark.parametrize("family", tuple(zoo.FAMILIES))
def test_int8_agrees_with_fp32_on_the_next_token(family, each_int8_gemm):
    model = zoo.build(family, "sdpa")
    ids = zoo.example_ids(model, POSITIONS)
    with torch.no_grad():
        expected = model(ids).logits[0].argmax(-1)
        actual = torch.compile(model, backend=ttftc.backend(ttftc.Config(precision="int8")))(ids).logits[0].argmax(-1)
    agreement = (actual == expected).float().mean().item()
    assert agreement >= MIN_AGREEMENT, (f"{family} through {each_int8_gemm}: top-1 agreement {agreement:.3f} over "
                                        f"{POSITIONS} positions")
