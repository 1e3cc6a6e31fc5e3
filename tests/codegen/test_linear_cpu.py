"""The CPU GEMM backends (cpu/_blas.py) and the CPU lowering of ttftc.linear against the reference."""

from __future__ import annotations

import pytest
import torch

import ttftc
from tests.codegen.conftest import GEMM_TUNINGS, fp32_gemm_options_or_skip, record_linear_2d
from tests.helpers import assert_logits_match, compile_and_run, needs_transformers
from ttftc import zoo
from ttftc.autotune.space import Problem, TensorSpec, space_for
from ttftc.codegen.cpu import _blas
from ttftc.codegen.cpu.measured import NEAR_TIE, prefer
from ttftc.codegen.cpu._blas import (cpu_linear_reason, default_gemm, default_wide_gemm_config, gemm_options, linear_2d,
                                     onednn_reason, wide_gemm_constraint)
from ttftc.codegen.cpu.linear import linear_cpu
import ttftc.codegen.providers  # noqa: F401  (registers every lowering and search space)
from ttftc.codegen.registry import LoweringContext, lowerings_for

CPU = LoweringContext("cpu", None)
# Against exact float64 sums of the same inputs. A bf16 result accumulated in fp32 is off by at most its one final
# rounding, 2**-8 relative (measured: 0.0038 at most); a GEMM that accumulated in bf16, or dropped a low-order
# term, would not pass. fp32: accumulation error only.
EXACT_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2**-8, rtol=2**-8)}
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _operands(dtype, m=7, k=12, n=37):
    g = torch.Generator().manual_seed(0)
    # A bias as large as the products, so a lost bias (or one added twice) is far outside any rounding.
    return (torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype),
            (torch.randn(n, generator=g) * 3).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemm,n_block", [("blas", 0), ("blas", 16), ("blas", 20), ("onednn", 0)])
@pytest.mark.parametrize("shape", [(7, 12, 37), (33, 200, 70)])
def test_each_gemm_backend_matches_exact_sums(dtype, gemm, n_block, shape):
    if gemm == "onednn" and onednn_reason(dtype):
        pytest.skip(onednn_reason(dtype))
    x, w, b = _operands(dtype, *shape)
    products = x.double() @ w.double().t()
    out = linear_2d(x, w, b, n_block, gemm=gemm)
    assert out.dtype == dtype and out.shape == (shape[0], shape[2])
    torch.testing.assert_close(out.double(), products + b.double(), **EXACT_TOLERANCE[dtype])
    torch.testing.assert_close(linear_2d(x, w, None, n_block, gemm=gemm).double(), products, **EXACT_TOLERANCE[dtype])


@needs_onednn
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("n_block, blocks", [
    (None, [(0, 10, False)]),  # the default: one GEMM
    (0, [(0, 10, False)]), (10, [(0, 10, False)]), (12, [(0, 10, False)]),
    (4, [(0, 4, True), (4, 8, True), (8, 10, True)]), (1, [(i, i + 1, True) for i in range(10)])])
def test_blas_makes_one_call_per_block_of_output_columns(monkeypatch, with_bias, n_block, blocks):
    x, w, b = _operands(torch.float32, k=12, n=10)
    calls = []

    def recording(real):
        def gemm(*args, out=None):
            weight = args[-1]  # w[start:stop].t(): its storage offset tells start
            start = weight.storage_offset() // w.shape[1]
            calls.append((start, start + weight.shape[1], out is not None))
            return real(*args) if out is None else real(*args, out=out)
        return gemm

    monkeypatch.setattr(torch, "addmm", recording(torch.addmm))
    monkeypatch.setattr(torch, "mm", recording(torch.mm))
    bias = b if with_bias else None
    out = linear_2d(x, w, bias) if n_block is None else linear_2d(x, w, bias, n_block)
    assert calls == blocks
    torch.testing.assert_close(out, x @ w.t() + (b if with_bias else 0))


def test_an_unknown_gemm_backend_is_refused_by_name():
    x, w, b = _operands(torch.float32)
    with pytest.raises(ValueError) as refused:
        linear_2d(x, w, b, gemm="mkl")
    assert str(refused.value) == "gemm 'mkl': the CPU linear runs one of ('onednn', 'blas')"


def test_onednn_reads_a_strided_activation_without_a_copy_in_the_caller():
    x, w, _ = _operands(torch.float32, k=24)
    wide = torch.randn(7, 48)
    half = wide[:, :24]  # how gated_ffn hands its gate half to the down GEMM
    torch.testing.assert_close(linear_2d(half, w, None, gemm="onednn"), half.contiguous() @ w.t(),
                               atol=1e-5, rtol=1e-5)


@pytest.fixture
def measured_backend(monkeypatch):
    """A fresh measurement of the default backend, with $TTFTC_CPU_GEMM unset; cleared again afterwards."""
    monkeypatch.delenv(_blas.GEMM_BACKEND_ENV, raising=False)
    _blas.measured_gemm_backend.cache_clear()
    yield monkeypatch
    _blas.measured_gemm_backend.cache_clear()


@pytest.mark.parametrize("onednn_ms, blas_ms, expected", [(5.3, 11.7, "onednn"), (12.0, 9.0, "blas")])
def test_the_default_backend_is_whichever_measured_faster(measured_backend, onednn_ms, blas_ms, expected):
    timings = {"onednn": onednn_ms, "blas": blas_ms}
    measured_backend.setattr(_blas, "_backend_ms", lambda backend, dtype: timings[backend])
    measured_backend.setattr(_blas, "onednn_reason", lambda dtype: None)
    choice = _blas.measured_gemm_backend(torch.float32)
    assert choice.backend == expected == default_gemm(torch.float32)
    assert gemm_options(None, torch.float32)["gemm"] == expected
    loser = "blas" if expected == "onednn" else "onednn"
    assert choice.describe() == (f"fp32 GEMM: {expected} ({timings[expected]:.1f} ms; {loser} {timings[loser]:.1f} ms "
                                 f"at 256x1024x1024; {choice.provenance.describe()})")
    assert not choice.provenance.loaded


def test_onednn_is_never_the_default_where_it_cannot_run(measured_backend):
    measured_backend.setattr(_blas, "_backend_ms", lambda backend, dtype: {"onednn": 1.0, "blas": 50.0}[backend])
    measured_backend.setattr(_blas, "onednn_reason", lambda dtype: "this torch build has no oneDNN")
    choice = _blas.measured_gemm_backend(torch.float32)
    assert choice.backend == "blas" and not choice.ms
    assert choice.describe() == "fp32 GEMM: blas (the only backend here: this torch build has no oneDNN)"
    # Given timings where oneDNN won, the policy still cannot pick it.
    assert _blas.choose_gemm_backend(torch.float32, {"onednn": 1.0, "blas": 50.0}).backend == "blas"


def test_the_environment_overrides_the_measurement(measured_backend):
    measured_backend.setattr(_blas, "_backend_ms", lambda backend, dtype: pytest.fail("measured despite the override"))
    measured_backend.setenv(_blas.GEMM_BACKEND_ENV, "blas")
    assert _blas.measured_gemm_backend(torch.float32).describe() == "fp32 GEMM: blas (set by TTFTC_CPU_GEMM)"
    _blas.measured_gemm_backend.cache_clear()
    measured_backend.setenv(_blas.GEMM_BACKEND_ENV, "mkl")
    with pytest.raises(ValueError, match="TTFTC_CPU_GEMM='mkl': expected one of onednn, blas"):
        _blas.measured_gemm_backend(torch.float32)


def test_the_real_measurement_times_both_backends_where_both_run(measured_backend):
    choice = _blas.measured_gemm_backend(torch.float32)
    assert choice.backend in ("onednn", "blas")
    if onednn_reason(torch.float32) is None:
        assert set(choice.ms) == {"onednn", "blas"} and all(t > 0 for t in choice.ms.values())
        # the faster one, or the preferred one where the two are within the noise (measured.prefer's near-tie)
        assert choice.backend == prefer(choice.ms, _blas.PREFERENCE)
        assert choice.ms[choice.backend] <= min(choice.ms.values()) * (1 + NEAR_TIE)


def test_fp16_and_tuned_entries_never_reach_onednn_where_it_cannot_run():
    assert gemm_options(None, torch.float16) == {"gemm": "blas", "n_block": 1024}  # fp16 is not on the oneDNN path
    # A cache entry tuned on a build with oneDNN degrades to BLAS for a dtype oneDNN does not cover.
    assert gemm_options({"gemm": "onednn", "n_block": 0}, torch.float16)["gemm"] == "blas"
    assert gemm_options({"gemm": "blas", "n_block": 512}, torch.float32) == {"gemm": "blas", "n_block": 512}


@needs_onednn
def test_search_space_prunes_column_blocks_for_onednn():
    space = space_for("linear", "cpu")
    problem = Problem("linear", "cpu", (TensorSpec((512, 576), torch.float32), TensorSpec((576, 576), torch.float32)), ())
    allowed, pruned = space.candidates(problem)
    gemm_knobs = [(c["gemm"], c["n_block"]) for c in allowed]
    default = gemm_options(None, torch.float32)  # whichever this machine measured faster
    assert gemm_knobs[0] == (default["gemm"], default["n_block"])  # the default comes first
    assert ("onednn", 1024) in [(c["gemm"], c["n_block"]) for c, _ in pruned]
    # onednn alone, and blas with each block size, each at every thread count the search tries.
    assert sorted(set(gemm_knobs)) == [("blas", 0), ("blas", 512), ("blas", 1024), ("blas", 2048), ("onednn", 0)]
    thread_choices = {c["num_threads"] for c in allowed}
    assert len(allowed) == 5 * len(thread_choices) and None in thread_choices


def test_lowering_matches_reference_and_states_its_limits():
    x, w, b = _operands(torch.float32)
    x3 = x.view(1, 7, 12)
    exact = (x.double() @ w.double().t() + b.double()).view(1, 7, 37)
    torch.testing.assert_close(linear_cpu(x3, w, b).double(), exact, **EXACT_TOLERANCE[torch.float32])
    for config in ({"gemm": "blas", "n_block": 16}, {"gemm": "onednn", "n_block": 0}, {"num_threads": 1}):
        torch.testing.assert_close(linear_cpu(x3, w, b, tuning_config=config).double(), exact,
                                   **EXACT_TOLERANCE[torch.float32])
    (entry,) = [e for e in lowerings_for("linear") if e.provider == "cpu"]
    assert entry.unsupported_reason(CPU, x3, w, b) is None
    assert "differs from activation dtype" in entry.unsupported_reason(CPU, x3, w.double(), b)
    # x3 is [1, 7, 12]: the width is its last axis, and the bias must have w's 37 rows
    assert entry.unsupported_reason(CPU, x3, w[:, :5], b) == "weight (37, 5) does not fit input width 12"
    assert entry.unsupported_reason(CPU, x3, w, b[:3]) == (
        "bias of shape (3,) / torch.float32 does not fit [37] / torch.float32")
    assert "tensors on cuda" in entry.unsupported_reason(LoweringContext("cuda", None), x3, w, b)


@pytest.mark.parametrize("gemm", ["onednn", "blas"])
def test_a_strided_bias_gives_the_same_numbers(gemm):
    if gemm == "onednn" and onednn_reason(torch.float32):
        pytest.skip(onednn_reason(torch.float32))
    x, w, _ = _operands(torch.float32)
    every_other = torch.randn(2 * w.shape[0], generator=torch.Generator().manual_seed(1))[::2]
    torch.testing.assert_close(linear_2d(x, w, every_other, gemm=gemm), torch.addmm(every_other, x, w.t()),
                               atol=1e-5, rtol=1e-5)


@needs_transformers
def test_every_linear_of_a_zoo_model_lowers_to_the_cpu_gemm():
    model = zoo.build("llama", "sdpa")
    actual, expected, report = compile_and_run(model, zoo.example_ids(model, 9), ttftc.Config(passes=("linear",)))
    assert report.providers["linear"] == {"cpu": 15}  # 7 linears per layer and the lm_head
    assert_logits_match(actual, expected)


def test_gemm_options_and_the_search_space_rules():
    assert default_gemm(torch.float16) == "blas"
    assert gemm_options({"n_block": 256}, torch.float16) == {"gemm": "blas", "n_block": 256}
    assert gemm_options({"gemm": "blas"}, torch.float32) == {"gemm": "blas", "n_block": 1024}
    assert gemm_options({"num_threads": 1}, torch.float16) == {"gemm": "blas", "n_block": 1024}
    # autotune entries are untrusted: a backend or block this build does not know falls back to the default
    for damaged in ({"gemm": "mkl"}, {"gemm": None}, {"n_block": "wide"}, {"n_block": True}, {"n_block": -8},
                    {"n_block": 512.5}):
        assert gemm_options(damaged, torch.float16) == {"gemm": "blas", "n_block": 1024}
    assert gemm_options({"gemm": "blas", "n_block": 0}, torch.float16) == {"gemm": "blas", "n_block": 0}
    problem = Problem("linear", "cpu", (TensorSpec((8, 16), torch.float16), TensorSpec((16, 16), torch.float16)), ())
    assert default_wide_gemm_config(problem) == {"gemm": "blas", "n_block": 1024}
    assert wide_gemm_constraint({"gemm": "blas", "n_block": 512}, problem) is None
    assert wide_gemm_constraint({"gemm": "onednn", "n_block": 512}, problem) == (
        "column blocks apply to the blas backend only")
    assert "not torch.float16" in wide_gemm_constraint({"gemm": "onednn", "n_block": 0}, problem)
    # the activation (first tensor) decides, whatever the other tensors' dtype
    mixed = Problem("linear", "cpu", (TensorSpec((8, 16), torch.float16), TensorSpec((16, 16), torch.float64)), ())
    assert wide_gemm_constraint({"gemm": "onednn", "n_block": 0}, mixed) == onednn_reason(torch.float16)


@needs_onednn
def test_where_onednn_is_the_measured_default_it_needs_no_column_blocks(measured_backend):
    measured_backend.setenv(_blas.GEMM_BACKEND_ENV, "onednn")
    assert onednn_reason(torch.float32) is None
    assert gemm_options(None, torch.float32) == {"gemm": "onednn", "n_block": 0}
    problem = Problem("linear", "cpu", (TensorSpec((8, 16), torch.float32), TensorSpec((16, 16), torch.float32)), ())
    assert default_wide_gemm_config(problem) == {"gemm": "onednn", "n_block": 0}
    assert wide_gemm_constraint({"gemm": "onednn", "n_block": 0}, problem) is None


def test_capability_rule_of_every_cpu_gemm():
    x, w, b = _operands(torch.float32)
    assert cpu_linear_reason(CPU, x, w, w) is None
    assert cpu_linear_reason(CPU, x.bfloat16(), w.bfloat16()) is None
    assert cpu_linear_reason(CPU, x.half(), w.half()) is None
    assert "tensors on npu" in cpu_linear_reason(LoweringContext("npu", None), x, w)
    assert "dtype torch.int32 not supported" in cpu_linear_reason(CPU, x.int(), w.int())
    assert "weight of rank 3 (want 2)" in cpu_linear_reason(CPU, x, w, w[None])
    assert "weight dtype torch.float16 differs" in cpu_linear_reason(CPU, x, w, w.half())
    (entry,) = [e for e in lowerings_for("linear") if e.provider == "cpu"]
    assert entry.unsupported_reason(CPU, x, w) is None
    assert "bias" in entry.unsupported_reason(CPU, x, w, b[None])
    assert "bias" in entry.unsupported_reason(CPU, x, w, b.half())


@pytest.mark.parametrize("available, native_bf16, dtype, reason", [
    (False, True, torch.float32, "this torch build has no oneDNN"),
    (True, True, torch.float16, "oneDNN GEMM path covers ['torch.float32', 'torch.bfloat16'], not torch.float16"),
    (True, False, torch.bfloat16, "this CPU has no native bf16 for oneDNN"),
    (True, False, torch.float32, None),
    (True, True, torch.bfloat16, None),
])
def test_the_onednn_probe_names_what_the_build_or_the_cpu_lacks(monkeypatch, available, native_bf16, dtype, reason):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: available)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native_bf16)
    assert onednn_reason.__wrapped__(dtype) == reason  # the uncached body: the cached one asks once per process


@pytest.mark.parametrize("tuning", GEMM_TUNINGS)
def test_the_linear_gemm_runs_with_the_tuned_options_else_the_dtypes_defaults(monkeypatch, tuning):
    from ttftc.codegen.cpu import linear as cpu_linear

    options = fp32_gemm_options_or_skip(tuning)
    calls = record_linear_2d(monkeypatch, cpu_linear)
    assert linear_cpu(torch.randn(2, 3, 16), torch.randn(24, 16), tuning_config=tuning).shape == (2, 3, 24)
    assert calls == [options]
