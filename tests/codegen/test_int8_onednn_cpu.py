"""int8_linear's second CPU GEMM: oneDNN's quantised linear on packed weights with u8 activations."""

import gc

import pytest
import torch

from ttftc.autotune.space import Problem, space_for
from ttftc.codegen.cpu import int8_linear as cpu_int8
from ttftc.codegen.cpu.int8_gemm_choice import FP32, choose
from ttftc.ops.int8_linear import quantize_per_token

# Unavailable in this build, or measured inexact on this CPU (no VNNI: int8_gemm_choice.py): refused either way.
_REFUSED = cpu_int8.int8_gemm_choice().refused.get("onednn_u8")
pytestmark = pytest.mark.skipif(_REFUSED is not None, reason=f"onednn_u8 refused here: {_REFUSED}")


@pytest.fixture(autouse=True)
def u8_usable_and_int_mm_default(pin_int8_gemm):
    """Pin a measurement in which _int_mm is the default and the u8 GEMM beats fp32, so a tuned "onednn_u8" runs
    the u8 path and the default runs _int_mm: on a loaded machine the real measurement may rank them otherwise,
    and a u8 knob measured slower than fp32 falls back to the default, which would compare a path with itself."""
    pin_int8_gemm(choose({FP32: 3.0, "int_mm": 1.0, "onednn_u8": 2.0}, cpu_int8.int8_gemm_choice().refused, (1, 1, 1)))


def _operands(m=37, k=64, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w_q, w_s = quantize_per_token(w)
    return torch.randn(2, m, k, generator=g), w_q, w_s.float(), torch.randn(n, generator=g)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_u8_path_matches_int_mm(out_dtype, with_bias):
    x, w_q, w_s, bias = _operands()
    bias = bias if with_bias else None
    via_int_mm = cpu_int8.int8_linear_cpu(x, None, w_q, w_s, bias, out_dtype=out_dtype)
    via_u8 = cpu_int8.int8_linear_cpu(x, None, w_q, w_s, bias, out_dtype=out_dtype, tuning_config={"gemm": "onednn_u8"})
    assert via_u8.dtype == out_dtype and via_u8.shape == via_int_mm.shape
    # Both accumulate exactly in int32; only the order of the two fp32 scale multiplies may differ.
    torch.testing.assert_close(via_u8.float(), via_int_mm.float(), rtol=1e-5 if out_dtype == torch.float32 else 1e-2,
                               atol=1e-5 if out_dtype == torch.float32 else 1e-2)


def test_u8_path_packs_a_transposed_view_weight_as_the_matrix_it_is():
    x, w_q, w_s, bias = _operands()
    w_view = w_q.t().contiguous().t()  # the same [N, K] values, stored column-major (GPT-2's Conv1D)
    expected = cpu_int8.int8_linear_cpu(x, None, w_q, w_s, bias, out_dtype=torch.float32,
                                        tuning_config={"gemm": "int_mm"})
    actual = cpu_int8.onednn_u8_gemm(*quantize_per_token(x.reshape(-1, 64)), w_view, w_s, bias, torch.float32)
    torch.testing.assert_close(actual.view_as(expected), expected, rtol=1e-5, atol=1e-5)


def test_u8_path_takes_a_fused_producers_int8_input():
    x, w_q, w_s, bias = _operands()
    xq, xs = quantize_per_token(x)
    expected = cpu_int8.int8_linear_cpu(xq, xs, w_q, w_s, bias, out_dtype=torch.float32)
    actual = cpu_int8.int8_linear_cpu(xq, xs, w_q, w_s, bias, out_dtype=torch.float32, tuning_config={"gemm": "onednn_u8"})
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_a_weight_is_packed_once_and_released_with_it():
    packed = cpu_int8.PackedWeights()
    _, w_q, _, _ = _operands()
    first = packed.get(w_q, 37)
    assert packed.get(w_q, 512) is first
    del w_q, first
    gc.collect()
    assert len(packed._entries) == 0


def test_each_live_weight_keeps_its_own_packing():
    packed = cpu_int8.PackedWeights()
    _, w_a, _, _ = _operands(seed=1)
    _, w_b, _, _ = _operands(seed=2)
    first_a, first_b = packed.get(w_a, 37), packed.get(w_b, 37)
    assert packed.get(w_a, 37) is first_a and packed.get(w_b, 37) is first_b and len(packed._entries) == 2


def test_the_gemm_is_a_knob_with_the_measured_choice_as_the_default():
    x, w_q, w_s, bias = _operands()
    space = space_for("int8_linear", "cpu", "cpu")
    problem = Problem.from_meta("int8_linear", "cpu", (x, None, w_q, w_s, bias), {"out_dtype": torch.float32})
    choice = cpu_int8.int8_gemm_choice()
    assert space.default(problem)["gemm"] == choice.gemm
    allowed, _ = space.candidates(problem)
    assert {c["gemm"] for c in allowed} == set(cpu_int8.INT8_GEMMS) - set(choice.refused)
    assert "onednn_u8" in {c["gemm"] for c in allowed}


# -- the packed weight across the compile cache and AOT artifacts ---------------------------------------------
# No file stores a packed oneDNN weight: a stored graph keeps only `tuning_config={"gemm": "onednn_u8"}` and the
# int8 weight, and the lowering packs again in the process that loads it.

def _choose_u8(monkeypatch):
    """Every int8_linear gets the u8 GEMM, as an autotune cache entry tuned on a CPU that prefers it would give."""
    from ttftc.codegen import lowering

    monkeypatch.setattr(lowering, "_tuned_config",
                        lambda op, provider, node, cache=None: {"gemm": "onednn_u8"} if op == "int8_linear" else None)


def _fresh_packs(monkeypatch) -> cpu_int8.PackedWeights:
    """A new process's empty pack table."""
    packs = cpu_int8.PackedWeights()
    monkeypatch.setattr(cpu_int8, "PACKED", packs)
    return packs


def _u8_nodes(graphs_dir) -> int:
    return sum(path.read_text().count('"onednn_u8"') for path in graphs_dir.rglob("*.json"))


def test_a_compile_cache_hit_repacks_the_weights_it_loads(tmp_path, monkeypatch):
    import ttftc
    from ttftc import zoo
    from ttftc.cache import CompileCache
    from ttftc.bucketed import compile_bucketed

    pytest.importorskip("transformers")
    config = ttftc.Config(buckets=(16,), precision="int8")
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 10)
    _choose_u8(monkeypatch)
    first_packs = _fresh_packs(monkeypatch)
    expected = compile_bucketed(model, config, cache=CompileCache(tmp_path))(ids, logits_to_keep=1).logits
    assert len(first_packs._entries) > 0 and _u8_nodes(tmp_path) > 0

    second_packs = _fresh_packs(monkeypatch)
    monkeypatch.setattr("ttftc.codegen.lowering.lower_graph", lambda *a, **k: pytest.fail("compiled on a cache hit"))
    reloaded = compile_bucketed(zoo.build("llama", "sdpa"), config, cache=CompileCache(tmp_path))
    out = reloaded(ids, logits_to_keep=1).logits
    assert reloaded.source.cache_hits == 1 and reloaded.source.compiles == 0
    assert len(second_packs._entries) == len(first_packs._entries)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_an_artifact_built_with_the_u8_gemm_loads_and_repacks(tmp_path, monkeypatch):
    import ttftc
    from ttftc.aot import build_artifact

    pytest.importorskip("transformers")
    config = ttftc.Config(buckets=(16,), precision="int8")
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    build_artifact("tiny", tmp_path / "int_mm", config, cache=None)
    _choose_u8(monkeypatch)
    build_artifact("tiny", tmp_path / "u8", config, cache=None)
    assert _u8_nodes(tmp_path / "u8") > 0 and _u8_nodes(tmp_path / "int_mm") == 0

    packs = _fresh_packs(monkeypatch)
    via_u8 = ttftc.load(tmp_path / "u8")(ids, logits_to_keep=1).logits
    assert len(packs._entries) > 0  # packed at the first call of the loaded graphs, not read from the artifact
    via_int_mm = ttftc.load(tmp_path / "int_mm")(ids, logits_to_keep=1).logits
    torch.testing.assert_close(via_u8, via_int_mm, rtol=1e-4, atol=1e-4)
