"""The tuner's search: pruning, correctness gate, budget, cache use, and the compile-time lookup."""

import time

import pytest
import torch

import ttftc
from ttftc.autotune import space as space_module
from ttftc.autotune.cache import AutotuneCache
from ttftc.autotune.keys import key_for
from ttftc.autotune.space import Problem, SearchSpace, TensorSpec
from ttftc.codegen import registry
from ttftc.codegen.registry import register_lowering
from ttftc.tuning.tuner import OpInstance, summary_table, tune_instances

PROBLEM = Problem(
    "gated_ffn", "toy", (TensorSpec((6, 8), torch.float32), TensorSpec((32, 8), torch.float32),
                         TensorSpec((8, 16), torch.float32)), (("act", "silu"),)
)


def _toy_impl(x, w_gate_up, w_down, b_gate_up=None, b_down=None, *, act, tuning_config=None):
    rows = (tuning_config or {}).get("rows", 2)
    if (tuning_config or {}).get("broken"):
        return torch.zeros(x.shape[0], w_down.shape[0])
    parts = [torch.ops.ttftc.gated_ffn.default(x[i : i + rows], w_gate_up, w_down, act=act)
             for i in range(0, x.shape[0], rows)]
    return torch.cat(parts)


def _rows_must_divide(config, problem):
    return None if problem.args[0].shape[0] % config["rows"] == 0 else f"rows {config['rows']} does not divide M"


@pytest.fixture
def toy_space(monkeypatch):
    monkeypatch.setattr(registry, "_LOWERINGS", {})
    monkeypatch.setattr(space_module, "_SPACES", {})
    register_lowering("gated_ffn", "toy", unsupported_reason=lambda ctx, *a, **k: None)(_toy_impl)
    return space_module.register_space(
        SearchSpace("gated_ffn", "toy", axes={"rows": (1, 2, 3, 4), "broken": (False, True)},
                    default=lambda p: {"rows": 2, "broken": False}, constraints=(_rows_must_divide,))
    )


class FavourTimer:
    """Deterministic: runs the candidate (so it really executes) and scores it by config alone."""

    def __init__(self, favourite):
        self.favourite, self.calls = favourite, 0

    def __call__(self, fn, config):
        fn()
        self.calls += 1
        return 1.0 if config == self.favourite else 5.0 + config["rows"]


def test_pruning_applies_constraints_and_keeps_the_default_first(toy_space):
    allowed, pruned = toy_space.candidates(PROBLEM)
    assert allowed[0] == {"rows": 2, "broken": False}
    assert {c["rows"] for c in allowed} == {1, 2, 3}
    assert {c["rows"] for c, _ in pruned} == {4} and "does not divide" in pruned[0][1]


def test_tuner_picks_what_the_timer_favours_and_never_a_wrong_config(toy_space, tmp_path):
    cache = AutotuneCache(tmp_path)
    favourite = {"rows": 3, "broken": False}
    (result,) = tune_instances([OpInstance(PROBLEM, 64)], cache=cache, budget_s=60, timer=FavourTimer(favourite),
                               progress=False)
    assert result.status == "tuned" and result.config == favourite
    assert result.default_ms == 7.0 and result.tuned_ms == 1.0
    assert len(result.rejected) == 3 and all("wrong numbers" in r for r in result.rejected)
    assert cache.lookup(key_for(PROBLEM, "cpu")).config == favourite
    assert "gated_ffn" in summary_table([result])

    timer = FavourTimer({"rows": 1, "broken": False})
    (again,) = tune_instances([OpInstance(PROBLEM, 64)], cache=cache, budget_s=60, timer=timer, progress=False)
    assert again.status == "cached" and again.config == favourite and timer.calls == 0


class SlowTimer(FavourTimer):
    def __call__(self, fn, config):
        time.sleep(0.3)
        return super().__call__(fn, config)


def test_budget_stops_the_search_but_measures_the_default(toy_space, tmp_path):
    second = PROBLEM.__class__(PROBLEM.op, PROBLEM.provider, PROBLEM.args, (("act", "gelu_tanh"),))
    first, skipped = tune_instances([OpInstance(PROBLEM, None), OpInstance(second, None)],
                                    cache=AutotuneCache(tmp_path), budget_s=0.1, timer=SlowTimer({}), progress=False)
    assert first.tried == 1 and first.config == {"rows": 2, "broken": False}
    assert skipped.status == "skipped: time budget used up"


@pytest.mark.parametrize("budget", [0, -5])
def test_non_positive_budget_is_refused_and_cache_untouched(toy_space, tmp_path, budget):
    with pytest.raises(ValueError, match="budget"):
        tune_instances([OpInstance(PROBLEM, None)], cache=AutotuneCache(tmp_path / "c"), budget_s=budget,
                       timer=FavourTimer({}), progress=False)
    assert not (tmp_path / "c").exists()


def test_compile_uses_the_cached_config(toy_space, tmp_path, monkeypatch):
    monkeypatch.setenv("TTFTC_AUTOTUNE_CACHE", str(tmp_path))
    AutotuneCache(tmp_path).store(key_for(PROBLEM, "cpu"), {"rows": 3, "broken": False}, 1.0, 2.0)
    seen = []

    def spy(*args, tuning_config=None, **kwargs):
        seen.append(tuning_config)
        return _toy_impl(*args, tuning_config=tuning_config, **kwargs)

    monkeypatch.setattr(registry, "_LOWERINGS", {})
    register_lowering("gated_ffn", "toy", unsupported_reason=lambda ctx, *a, **k: None)(spy)

    def fn(x, wgu, wd):
        return torch.ops.ttftc.gated_ffn.default(x, wgu, wd, act="silu")

    x, wgu, wd = torch.randn(6, 8), torch.randn(32, 8), torch.randn(8, 16)
    with torch.no_grad():
        out = torch.compile(fn, backend=ttftc.backend(ttftc.Config(passes=())))(x, wgu, wd)
    assert seen == [{"rows": 3, "broken": False}]
    torch.testing.assert_close(out, torch.ops.ttftc.gated_ffn(x, wgu, wd, act="silu"))


def test_correctness_gate_scales_with_the_output_magnitude():
    from ttftc.tuning.tuner import _close

    expected = torch.tensor([6000.0, -3000.0, 0.001, 0.0])
    reassociated = expected + torch.tensor([0.004, -0.002, 0.008, -0.008])  # ~1e-6 of the largest entry
    assert _close(reassociated, expected)
    assert not _close(expected * 1.01, expected)
    assert not _close(torch.zeros(4), expected)


def test_correctness_gate_catches_a_bf16_gemm_that_drops_its_bias():
    from ttftc.tuning.tuner import _close

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 1536, generator=g).bfloat16(), (torch.randn(256, 1536, generator=g) * 0.05).bfloat16()
    bias = torch.randn(256, generator=g).bfloat16()
    expected = torch.addmm(bias, x, w.t())
    assert _close(torch.addmm(bias.float(), x.float(), w.float().t()).bfloat16(), expected)  # same maths, fp32 sums
    assert not _close(x @ w.t(), expected)


class NearlyEqualTimer:
    """The favourite is faster than the default by less than the noise margin."""

    def __init__(self, favourite):
        self.favourite = favourite

    def __call__(self, fn, config):
        fn()
        return 9.9 if config == self.favourite else 10.0


def test_a_gain_within_noise_keeps_the_default(toy_space, tmp_path):
    from ttftc.tuning.tuner import MIN_GAIN

    assert 0.1 / 10.0 < MIN_GAIN
    cache = AutotuneCache(tmp_path)
    (result,) = tune_instances([OpInstance(PROBLEM, 64)], cache=cache, budget_s=60,
                               timer=NearlyEqualTimer({"rows": 3, "broken": False}), progress=False)
    assert result.config == {"rows": 2, "broken": False} and result.tuned_ms == result.default_ms == 10.0
    assert cache.lookup(key_for(PROBLEM, "cpu")).config == {"rows": 2, "broken": False}
