"""A real Triton kernel tuned under the interpreter: the search runs each candidate kernel, checks it against the
reference, and keeps the config a deterministic stand-in timer favours."""

import dataclasses

import pytest
import torch

from tests.helpers import needs_triton
from ttftc.autotune import space as space_module
from ttftc.autotune.cache import AutotuneCache
from ttftc.autotune.space import Problem, TensorSpec, space_for
import ttftc.codegen.providers  # noqa: F401  (importing it registers every lowering and search space)
from ttftc.tuning.tuner import OpInstance, tune_instances

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
    space = space_for("attention", "triton")
    allowed, pruned = space.candidates(PROBLEM)
    assert allowed and pruned
    assert all(c["block_m"] <= 32 for c in allowed), "BLOCK_M must not exceed the 20-row prompt's power of two"
    assert all(c["block_n"] <= 64 for c in allowed), "fp32 key tiles are capped at 64"
    assert any("larger than the 20-row prompt" in reason for _, reason in pruned)


def test_interpreted_kernel_is_tuned_to_the_timers_favourite(tmp_path, monkeypatch):
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


def _attention_module():
    from ttftc.codegen.triton import attention

    return attention


def test_space_rule_prunes_by_the_query_shape_dtype_and_current_target(monkeypatch):
    from ttftc.codegen.triton.targets import get_target

    mod = _attention_module()
    # The query's head dim (16), not its 64 heads or 64 rows, sizes the accumulator; its 64 rows, not the keys' 8,
    # bound BLOCK_M.
    problem = Problem("attention", "triton", (TensorSpec((1, 64, 64, 16), torch.float32),
                                              TensorSpec((1, 1, 8, 16), torch.float32),
                                              TensorSpec((1, 1, 8, 16), torch.float32)), ())
    monkeypatch.setattr(mod, "current_target", lambda: None)
    assert mod._space_rule({"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 1}, problem) is None
    assert mod._space_rule({"block_m": 64, "block_n": 16, "num_warps": 8, "num_stages": 1}, problem) is None
    assert mod._space_rule({"block_m": 128, "block_n": 16, "num_warps": 8, "num_stages": 1}, problem) == \
        "BLOCK_M 128 is larger than the 64-row prompt"
    # fp32 has its own register budget: (32*128 + 32*16) / 128 = 36 values per lane.
    assert mod._space_rule({"block_m": 32, "block_n": 128, "num_warps": 4, "num_stages": 1}, problem) == \
        "BLOCK_N above the head dim and 64"
    assert mod._space_rule({"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 1}, problem) == \
        "40 fp32 score and accumulator values per lane (over 24) spill registers"
    monkeypatch.setattr(mod, "current_target", lambda: get_target("gfx942"))
    assert mod._space_rule({"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 3}, problem) == \
        "8 wave64 warps have 256 VGPRs per lane: K/V tiles this wide and deep spill"


def test_space_default_is_the_interpreters_or_the_current_gpus(monkeypatch):
    from ttftc.codegen.triton.targets import get_target

    mod = _attention_module()
    problem = Problem("attention", "triton", (TensorSpec((1, 2, 20, 128), torch.float16),
                                              TensorSpec((1, 1, 20, 64), torch.float16),
                                              TensorSpec((1, 1, 20, 64), torch.float16)), ())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert mod._space_default(problem) == {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1}
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(mod, "current_target", lambda: get_target("sm_80"))
    # The query's head dim 128 (the keys' 64 or the 20 rows would give BLOCK_N 64).
    assert mod._space_default(problem) == {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 3}
    monkeypatch.setattr(mod, "current_target", lambda: get_target("gfx942"))
    assert mod._space_default(problem) == {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 2}
    fp32 = Problem("attention", "triton", (TensorSpec((1, 2, 20, 128), torch.float32),) * 3, ())
    assert mod._space_default(fp32) == {"block_m": 32, "block_n": 16, "num_warps": 8, "num_stages": 2}
