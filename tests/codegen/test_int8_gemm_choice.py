"""The int8 GEMM is chosen by what this CPU measures: exact candidates only, and never one slower than fp32.

CI runs on whatever CPU it gets, so each CPU class's choice is asserted with its measurements injected (the figures
are those of the issue that found the AVX2 problem and of earlier sessions' notes, each on the CPU named), and the
refusal of an inexact GEMM with a stand-in that computes as AVX2's saturating `vpmaddubsw` does.
"""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch

from ttftc.autotune.space import Problem, space_for
from ttftc.codegen.cpu import int8_linear as cpu
from ttftc.codegen.cpu.int8_gemm_choice import (FP32, Int8GemmChoice, choose, exactness_reason, full_range_operands,
                                                measure)
from ttftc.ops.quant import gated_ffn_int8
from ttftc.ops.int8_linear import int8_linear, quantize_per_token
from ttftc.tuning.timing import WallTimer
from ttftc.tuning.tuner import tune_problem

SATURATED = "differs from the exact int32 product"


def saturating_u8_gemm(xq, x_scale, w_int8, w_scale, bias, out_dtype):
    """A u8·s8 GEMM as AVX2 without VNNI computes it: products of adjacent pairs summed into a saturating int16
    (vpmaddubsw), then widened and summed (vpmaddwd), with the zero point's 128·Σw taken off after."""
    u8 = xq.to(torch.int32) + 128
    products = u8[:, None, :] * w_int8.to(torch.int32)[None, :, :]
    pairs = (products[..., 0::2] + products[..., 1::2]).clamp_(-32768, 32767)
    acc = pairs.sum(-1) - 128 * w_int8.to(torch.int32).sum(-1)
    out = acc.float() * w_scale * x_scale.reshape(-1, 1)
    if bias is not None:
        out += bias
    return out.to(out_dtype)


# -- the policy, per CPU class ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cpu_class, ms, refused, chosen", [
    # AMD EPYC Zen 3 (AVX2, no VNNI): _int_mm is ATen's plain loop, the u8 GEMM saturates (issue 29's figures),
    # and ttftc's exact native kernel (sign trick) beats fp32; without the extension, fp32 runs.
    ("avx2", {FP32: 11.7, "int_mm": 420.0, "native_avx2": 7.2}, {"onednn_u8": SATURATED}, "native_avx2"),
    ("avx2, no extension", {FP32: 11.7, "int_mm": 420.0}, {"onednn_u8": SATURATED,
                                                           "native_avx2": "native kernels not built"}, FP32),
    # The same CPU class with a build whose oneDNN lacks the quantised linear.
    ("avx2, no qlinear", {FP32: 11.7, "int_mm": 420.0}, {"onednn_u8": "this torch build has no oneDNN"}, FP32),
    # Intel Xeon (AVX-512 + VNNI, no bf16).
    ("avx512+vnni", {FP32: 6.9, "int_mm": 0.7, "onednn_u8": 0.8}, {}, "int_mm"),
    # AMD EPYC Zen 4 (AVX512-BF16, VNNI), where the u8 GEMM measured 0.92x _int_mm's time at M=512.
    ("avx512_bf16", {FP32: 5.0, "int_mm": 1.2, "onednn_u8": 1.1}, {}, "onednn_u8"),
    # AMX: both int8 GEMMs far ahead of fp32; the faster wins.
    ("amx", {FP32: 4.0, "int_mm": 0.2, "onednn_u8": 0.3}, {}, "int_mm"),
    # An int8 GEMM that only ties fp32 does not win: the quantisation passes would make it a loss.
    ("tie", {FP32: 5.0, "int_mm": 5.0}, {"onednn_u8": SATURATED}, FP32),
])
def test_each_cpu_class_gets_its_fastest_exact_gemm(cpu_class, ms, refused, chosen):
    choice = choose(ms, refused, (512, 576, 1536))
    assert choice.gemm == chosen, cpu_class
    assert choice.int8_speedup == ms[FP32] / min(t for name, t in ms.items() if name != FP32)


def test_a_candidate_is_usable_where_exact_and_not_slower_than_fp32():
    choice = choose({FP32: 11.7, "int_mm": 420.0, "fast": 5.0}, {"onednn_u8": SATURATED}, (512, 576, 1536))
    assert [choice.usable(name) for name in (FP32, "fast", "int_mm", "onednn_u8", "unmeasured")] == [
        True, True, False, False, True]


def test_describe_names_the_choice_every_time_and_every_refusal():
    choice = choose({FP32: 11.7, "int_mm": 420.0}, {"onednn_u8": "differs (max difference 3)"}, (512, 576, 1536))
    assert choice.describe() == ("int8 GEMM: fp32 (11.7 ms; int_mm 420.0 ms; onednn_u8 refused: differs (max "
                                 "difference 3) at 512x576x1536)")
    assert math.isclose(choice.int8_speedup, 11.7 / 420.0)
    assert math.isnan(choose({FP32: 1.0}, {}, (1, 1, 1)).int8_speedup)


# -- a measured choice whose provider went away is never called ------------------------------------------------

AVX2_MEASURED = ({FP32: 11.7, "int_mm": 420.0, "native_avx2": 7.2, "onednn_u8": 0.5}, {}, (256, 1024, 1024))


def test_a_choice_without_its_provider_falls_to_the_next_measured_candidate():
    choice = choose(*AVX2_MEASURED)
    assert choice.gemm == "onednn_u8" and choice.without({}) is choice
    fallen = choice.without({"onednn_u8": "no qlinear here"})
    assert fallen.gemm == "native_avx2" and fallen.refused == {"onednn_u8": "no qlinear here"}
    assert fallen.without({"native_avx2": "switched off"}).gemm == FP32  # int_mm measured slower than fp32
    assert choice.without({FP32: "never unavailable"}) is choice
    assert Int8GemmChoice("native_avx2", (1, 1, 1)).without({"native_avx2": "switched off"}).gemm == FP32


def test_the_int8_lowerings_never_call_a_measured_gemm_whose_extension_is_switched_off(monkeypatch, pin_int8_gemm):
    """The AVX2 Zen 3 failure (issue 40): the process measured native_avx2, then the native kernels went away."""
    from tests.codegen.conftest import NativeOff

    pin_int8_gemm(choose({FP32: 11.7, "int_mm": 420.0, "native_avx2": 7.2}, {"onednn_u8": SATURATED},
                         (256, 1024, 1024)))
    monkeypatch.setattr(cpu, "_native", NativeOff)
    torch.manual_seed(0)
    x = torch.randn(37, 64)
    w, s = quantize_per_token(torch.randn(48, 64) * 0.1)
    for tuned in (None, {"gemm": "native_avx2"}):
        actual = cpu.int8_linear_cpu(x, None, w, s, out_dtype=torch.float32, tuning_config=tuned)
        torch.testing.assert_close(actual, int8_linear.reference(x, None, w, s, out_dtype=torch.float32))
    w_gu, s_gu = quantize_per_token(torch.randn(192, 64) * 0.1)
    w_d, s_d = quantize_per_token(torch.randn(64, 96) * 0.1)
    actual = cpu.gated_ffn_int8_cpu(x, None, w_gu, s_gu, w_d, s_d, act="silu", out_dtype=torch.float32)
    expected = gated_ffn_int8.reference(x, None, w_gu, s_gu, w_d, s_d, act="silu", out_dtype=torch.float32)
    torch.testing.assert_close(actual, expected, atol=2e-3 * expected.abs().max().item(), rtol=0)
    assert cpu.default_gemm() == FP32
    assert cpu._refused_gemm_constraint({"gemm": "native_avx2"}, None) == "switched off by the test"
    assert space_for("int8_linear", "cpu", "cpu").default(None)["gemm"] == FP32


# -- exactness, checked before anything is timed ---------------------------------------------------------------

def test_a_saturating_gemm_is_refused_and_the_real_candidates_are_exact():
    reason = exactness_reason(saturating_u8_gemm)
    assert reason is not None and reason.startswith(SATURATED), reason
    for name, gemm in cpu.GEMMS.items():
        if name not in cpu._unavailable_gemms():
            measured = cpu.int8_gemm_choice().refused.get(name)
            assert exactness_reason(gemm) == measured, name  # the process's check says the same


def layout_blind_gemm(xq, x_scale, w_int8, w_scale, bias, out_dtype):
    """A GEMM that reads the weight's storage as row-major [N, K] whatever its strides (the bug the u8 path had
    on GPT-2's transposed Conv1D weights)."""
    storage_order = torch.as_strided(w_int8, w_int8.shape, (w_int8.shape[1], 1))
    return cpu.fp32_gemm(xq, x_scale, storage_order, w_scale, bias, out_dtype)


def test_a_gemm_that_misreads_a_transposed_weight_is_refused():
    reason = exactness_reason(layout_blind_gemm)
    assert reason is not None and "with a transposed-view weight" in reason, reason


def test_full_range_operands_reach_the_products_that_saturate():
    xq, w = full_range_operands(4, 64, 4)
    assert int(xq.min()) == -128 and int(xq.max()) == 127 and int(w.min()) == -127 and int(w.max()) == 127
    u8_pairs = (xq[0].int() + 128)[0::2] * w[0].int()[0::2] + (xq[0].int() + 128)[1::2] * w[0].int()[1::2]
    assert int(u8_pairs.max()) > 32767  # a 16-bit pair sum overflows on these rows


def test_measure_refuses_before_it_times_and_gives_up_on_a_hopeless_candidate():
    calls = {"saturating": 0, "slow": 0}

    def counted(name, gemm):
        def run(*args):
            calls[name] += 1
            return gemm(*args)
        return run

    def slow(*args):
        time.sleep(0.3)  # far beyond 8x a 16x64x64 fp32 GEMM, even on a loaded machine
        return cpu.fp32_gemm(*args)

    choice = measure({FP32: cpu.fp32_gemm, "saturating": counted("saturating", saturating_u8_gemm),
                      "slow": counted("slow", slow), "absent": cpu.fp32_gemm},
                     {"absent": "not in this build"}, shape=(16, 64, 64))
    assert choice.gemm == FP32 and set(choice.ms) == {FP32, "slow"}
    assert choice.refused["saturating"].startswith(SATURATED) and choice.refused["absent"] == "not in this build"
    assert calls == {"saturating": 1, "slow": 3}  # exactness (2 layouts), then one timed call: hopeless, not repeated


def test_an_inexact_fp32_fallback_is_an_error_not_a_choice():
    with pytest.raises(RuntimeError, match="fp32 fallback GEMM is not exact"):
        measure({FP32: saturating_u8_gemm}, {}, shape=(16, 64, 64))


def test_choosing_fp32_warns_once_with_the_measurements(monkeypatch):
    slow_int8 = choose({FP32: 11.7, "int_mm": 420.0}, {"onednn_u8": SATURATED}, (256, 1024, 1024))
    monkeypatch.setattr(cpu, "_recorded_choice", lambda: slow_int8)
    with pytest.warns(RuntimeWarning, match=r"no int8 GEMM beats fp32 here \(int8 GEMM: fp32 \(11.7 ms; int_mm "):
        assert cpu.int8_gemm_choice.__wrapped__() is slow_int8
    fast_int8 = choose({FP32: 6.9, "int_mm": 0.7}, {}, (256, 1024, 1024))
    monkeypatch.setattr(cpu, "_recorded_choice", lambda: fast_int8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu.int8_gemm_choice.__wrapped__() is fast_int8


# -- the tripwire: no _int_mm where it measured slower than fp32 -----------------------------------------------

@pytest.fixture
def int_mm_forbidden(monkeypatch, pin_int8_gemm):
    """A CPU whose probe measured _int_mm slower than fp32 (and the u8 GEMM inexact); _int_mm now fails the test."""
    pin_int8_gemm(choose({FP32: 11.7, "int_mm": 420.0}, {"onednn_u8": SATURATED}, (256, 1024, 1024)))
    monkeypatch.setattr(torch, "_int_mm", lambda *a: pytest.fail("torch._int_mm called where it measured slower"))
    monkeypatch.setattr(torch.ops.aten._int_mm, "default",
                        lambda *a: pytest.fail("aten._int_mm called where it measured slower"), raising=False)


def test_the_int8_lowerings_never_call_int_mm_where_it_is_slower(int_mm_forbidden):
    torch.manual_seed(0)
    x = torch.randn(37, 64)
    w, s = quantize_per_token(torch.randn(48, 64) * 0.1)
    bias = torch.randn(48)
    for tuned in (None, {"gemm": "int_mm"}, {"gemm": "onednn_u8"}):  # a tuned knob that is refused here falls back
        actual = cpu.int8_linear_cpu(x, None, w, s, bias, out_dtype=torch.float32, tuning_config=tuned)
        torch.testing.assert_close(actual, int8_linear.reference(x, None, w, s, bias, out_dtype=torch.float32))
    w_gu, s_gu = quantize_per_token(torch.randn(192, 64) * 0.1)
    w_d, s_d = quantize_per_token(torch.randn(64, 96) * 0.1)
    actual = cpu.gated_ffn_int8_cpu(x, None, w_gu, s_gu, w_d, s_d, act="silu", out_dtype=torch.float32)
    expected = gated_ffn_int8.reference(x, None, w_gu, s_gu, w_d, s_d, act="silu", out_dtype=torch.float32)
    torch.testing.assert_close(actual, expected, atol=2e-3 * expected.abs().max().item(), rtol=0)


def test_a_weight_holding_minus_128_never_falls_back_to_int_mm_where_it_is_slower(int_mm_forbidden):
    if cpu.native_int8_reason() is not None:
        pytest.skip(cpu.native_int8_reason())
    xq, w = full_range_operands(9, 40, 16, seed=6)
    w[3, 7] = -128  # outside the quantiser's range: the native GEMM cannot pack it
    ones = torch.ones(9), torch.ones(16)
    with pytest.warns(RuntimeWarning, match="holds -128"):
        out = cpu.native_int8_gemm(xq, ones[0], w, ones[1], None, torch.float32)
    assert torch.equal(out, (xq.long() @ w.long().t()).float())


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_a_compiled_int8_model_never_calls_int_mm_where_it_is_slower(int_mm_forbidden, codegen):
    pytest.importorskip("transformers")
    import ttftc
    from ttftc import zoo

    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 12)
    compiled = ttftc.compile(model, ttftc.Config(precision="int8", codegen=codegen, buckets=None))
    with torch.inference_mode():
        expected = model(ids).logits[:, -1]
        actual = compiled(ids).logits[:, -1]
    # W8A8 against fp32 eager: the quantisation error, not the GEMM's (tests/quality holds the agreement bar).
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(actual, expected, atol=0.05 * float(expected.abs().max()), rtol=0)


# -- autotune checks before it times ---------------------------------------------------------------------------

def test_autotune_rejects_a_saturating_gemm_on_its_full_range_tuning_inputs(monkeypatch, pin_int8_gemm):
    pin_int8_gemm("int_mm")  # as if the process's own check had not refused it: the tuner must catch it alone
    monkeypatch.setitem(cpu.GEMMS, "onednn_u8", saturating_u8_gemm)
    space = space_for("int8_linear", "cpu", "cpu")
    x, w = torch.randn(64, 256), torch.zeros(256, 256, dtype=torch.int8)
    problem = Problem.from_meta("int8_linear", "cpu", (x, None, w, torch.ones(256)), {"out_dtype": torch.float32})
    result = tune_problem(problem, space, cpu.int8_linear_cpu, device="cpu", timer=WallTimer("cpu"),
                          deadline=time.monotonic() + 60)
    rejected = [r for r in result.rejected if "'onednn_u8'" in r]
    assert rejected and all("wrong numbers against the reference" in r for r in rejected), result.rejected
    assert result.config["gemm"] != "onednn_u8"


def test_the_measured_choice_here_is_exact_and_described(measured_int8_gemm):
    choice = measured_int8_gemm()
    assert isinstance(choice, Int8GemmChoice) and choice.gemm in cpu.GEMMS and choice.gemm not in choice.refused
    assert FP32 in choice.ms and choice.describe().startswith(f"int8 GEMM: {choice.gemm} (")


# -- the AVX2 class on this machine: oneDNN capped at AVX2, the native kernels forced down ----------------------

_CAPPED_RUN = """
import json, torch
from ttftc.codegen.cpu import _native, int8_linear as cpu
from ttftc.ops.int8_linear import int8_linear, quantize_per_token
choice = cpu.int8_gemm_choice()
torch.manual_seed(0)
x = torch.randn(40, 256)
w, s = quantize_per_token(torch.randn(64, 256) * 0.1)
expected = int8_linear.reference(x, None, w, s, out_dtype=torch.float32)
errors = {name: float((cpu.int8_linear_cpu(x, None, w, s, out_dtype=torch.float32, tuning_config={"gemm": name})
                       - expected).abs().max()) for name in cpu.GEMMS if choice.usable(name)}
print(json.dumps({"gemm": choice.gemm, "refused": choice.refused, "errors": errors, "isa": _native.isa(),
                  "native": _native.unavailable_reason() is None}))
"""


def test_the_choice_under_onednn_capped_at_avx2_runs_only_exact_gemms():
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "TTFTC_NATIVE_ISA": "avx2"}
    run = subprocess.run([sys.executable, "-c", _CAPPED_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["gemm"] not in result["refused"] and result["gemm"] in result["errors"]
    assert all(error < 1e-4 for error in result["errors"].values()), result
    assert not result["native"] or result["isa"] == "avx2"  # the whole process ran the AVX2 kernels


def test_explain_names_the_int8_gemm_chosen_here_and_only_for_int8():
    pytest.importorskip("transformers")
    import ttftc
    from ttftc import zoo

    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 12)
    note = cpu.int8_gemm_choice().describe()
    assert note in ttftc.explain(model, ids, config=ttftc.Config(precision="int8")).notes
    assert note not in ttftc.explain(model, ids, config=ttftc.Config(precision="fp32")).notes


def test_the_int8_gemm_override_runs_an_exact_gemm_and_refuses_a_wrong_or_unknown_one(monkeypatch):
    """$TTFTC_INT8_GEMM picks the int8 GEMM without timing (another CPU class's choice, emulated here), but only one
    that is exact on this machine: an override may be slower, never wrong."""
    monkeypatch.setenv(cpu.INT8_GEMM_ENV, "fp32")
    forced = cpu._recorded_choice()
    assert forced.gemm == "fp32" and forced.ms == {} and "set by TTFTC_INT8_GEMM=fp32" in forced.describe()
    monkeypatch.setenv(cpu.INT8_GEMM_ENV, "int8_magic")
    with pytest.raises(ValueError, match="expected one of int_mm, onednn_u8, native_avx2, fp32"):
        cpu._recorded_choice()
    monkeypatch.setenv(cpu.INT8_GEMM_ENV, "int_mm")
    monkeypatch.setitem(cpu.GEMMS, "int_mm", lambda xq, xs, w, ws, bias, out_dtype: torch.zeros(
        xq.shape[0], w.shape[0], dtype=out_dtype))  # a GEMM that is wrong on any operands
    with pytest.raises(ValueError, match="cannot run exactly here"):
        cpu._recorded_choice()
