"""A real Triton kernel tuned under the interpreter: the search runs each candidate kernel, checks it against the
reference, and keeps the config a deterministic stand-in timer favours."""

import dataclasses

import pytest
import torch

from tests.helpers import needs_triton
from ttftc.autotune import space as space_module
from ttftc.autotune.cache import AutotuneCache
from ttftc.autotune.space import Problem, TensorSpec, space_for
from ttftc.autotune.tuner import OpInstance, tune_instances
from ttftc.codegen.lowering import load_providers

pytestmark = [needs_triton, pytest.mark.interpreter]

PROBLEM = Problem(
    "attention", "triton",
    (TensorSpec((1, 2, 20, 16), torch.float32), TensorSpec((1, 1, 20, 16), torch.float32),
     TensorSpec((1, 1, 20, 16), torch.float32)),
    (("causal", True), ("q_offset", 0), ("scale", 0.25), ("window", 0)),
)


class FavourTimer:
    def __init__(self, favourite):
        self.favourite, self.ran = favourite, []

    def __call__(self, fn, config):
        fn()
        self.ran.append(config)
        return 1.0 if config == self.favourite else 2.0


def test_pruning_follows_the_kernel_constraints():
    load_providers()
    space = space_for("attention", "triton")
    allowed, pruned = space.candidates(PROBLEM)
    assert allowed and pruned
    assert all(c["block_m"] <= 32 for c in allowed), "BLOCK_M must not exceed the 20-row prompt's power of two"
    assert all(c["block_n"] <= 64 for c in allowed), "fp32 key tiles are capped at 64"
    assert any("larger than the 20-row prompt" in reason for _, reason in pruned)


def test_interpreted_kernel_is_tuned_to_the_timers_favourite(tmp_path, monkeypatch):
    load_providers()
    space = space_for("attention", "triton")
    # Keep the interpreter's work small: two tile shapes, one warp/stage setting.
    small = dataclasses.replace(space, axes={"block_m": (16, 32), "block_n": (16, 32), "num_warps": (4,),
                                             "num_stages": (1,)})
    monkeypatch.setitem(space_module._SPACES, ("attention", "triton"), small)
    favourite = {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 1}
    timer = FavourTimer(favourite)
    (result,) = tune_instances([OpInstance(PROBLEM, 32)], cache=AutotuneCache(tmp_path), budget_s=600, timer=timer,
                               progress=False)
    assert result.status == "tuned", result.rejected
    assert result.config == favourite
    assert result.rejected == []
    assert len(timer.ran) == result.tried >= 4
