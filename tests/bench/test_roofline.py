"""The FLOP formula of a prefill, checked against hand computations, and the GEMM peak measurement."""

from __future__ import annotations

import pytest
import torch

from ttftc import zoo
from ttftc.bench.roofline import (
    GemmPeak,
    PeakMeter,
    bound_ms,
    causal_pairs,
    describe_prefill,
    measure_gemm_peak,
    prefill_flops,
)


def test_llama_prefill_flops_by_hand():
    # hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 256
    model = zoo.build("llama", num_key_value_heads=2)
    seq, h, inter, layers, heads, kv_heads, hd, vocab = 10, 64, 128, 2, 4, 2, 16, 256
    per_token_per_layer = (
        h * heads * hd  # q_proj
        + 2 * h * kv_heads * hd  # k_proj, v_proj
        + heads * hd * h  # o_proj
        + 3 * h * inter  # gate, up, down
    )
    linear = 2 * seq * layers * per_token_per_layer
    # causal: query i sees i keys (1-based), so 1 + 2 + ... + 10 = 55 pairs; QK^T and PV, 2 FLOPs per MAC
    attention = layers * 2 * 2 * heads * hd * 55
    lm_head = 2 * h * vocab  # the last token only
    assert prefill_flops(describe_prefill(model), seq) == linear + attention + lm_head


def test_gpt2_conv1d_layers_are_counted():
    model = zoo.build("gpt2")  # hidden 64, 2 layers, 4 heads, MLP 4 x hidden, vocab 256, merged c_attn
    seq, h, layers = 7, 64, 2
    per_token_per_layer = h * 3 * h + h * h + h * 4 * h + 4 * h * h  # c_attn, c_proj, c_fc, mlp.c_proj
    expected = 2 * seq * layers * per_token_per_layer + layers * 4 * 4 * 16 * (7 * 8 // 2) + 2 * h * 256
    assert prefill_flops(describe_prefill(model), seq) == expected


def test_sliding_window_caps_the_keys_per_query():
    assert causal_pairs(5) == 15
    assert causal_pairs(5, window=2) == 1 + 2 + 2 + 2 + 2
    assert causal_pairs(5, window=8) == 15
    model = zoo.build("mistral", sliding_window=4)
    shape = describe_prefill(model)
    assert shape.windows == (4, 4)
    narrow = prefill_flops(shape, 6)
    full = prefill_flops(describe_prefill(zoo.build("mistral")), 6)
    # 21 pairs without a window, 1+2+3+4+4+4 = 18 with it
    assert full - narrow == 2 * 4 * 4 * 16 * (21 - 18)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_gemm_peak_is_measured_for_every_dtype(dtype):
    peak = measure_gemm_peak(dtype, size=128, repeats=2)
    assert peak.error is None, peak.error
    assert peak.gflops > 0
    if dtype == "int8":
        from ttftc.codegen.cpu.int8_linear import int8_gemm_choice

        assert peak.op == f"ttftc int8 GEMM: {int8_gemm_choice().gemm}"
    else:
        assert peak.op in ("torch.mm", "oneDNN matmul")


def test_peak_meter_keeps_the_best_sample():
    meter = PeakMeter(size=128, dtypes=("fp32", "int8"))
    meter.sample(2)
    first = meter.peaks()
    meter.sample()
    later = meter.peaks()
    assert first["fp32"].samples == 2 and later["fp32"].samples == 3 and later["int8"].samples == 3
    assert later["fp32"].gflops >= first["fp32"].gflops > 0


def test_bound_is_flops_over_peak():
    peak = GemmPeak("fp32", 200.0, "torch.mm", 2048)
    assert bound_ms(4 * 10**9, peak) == pytest.approx(20.0)
    assert bound_ms(10**9, GemmPeak("int8", None, "torch._int_mm", 2048, error="no int8 GEMM")) is None


def test_peak_is_the_best_over_every_gemm_primitive_of_the_device():
    from ttftc.bench.roofline import PeakMeter
    from ttftc.codegen.cpu.int8_linear import int8_gemm_choice

    meter = PeakMeter(size=64, dtypes=("fp32", "bf16", "int8"))
    names = {d: [g[0] for g in meter._gemms[d]] for d in ("fp32", "bf16", "int8")}
    expected = ["torch.mm"] + (["oneDNN matmul"] if torch.backends.mkldnn.is_available() else [])
    assert names["fp32"] == expected
    # oneDNN's bf16 matmul needs AVX-512 (or AVX-NE-CONVERT): elsewhere it raises at warm-up and is left out.
    assert names["bf16"] in (expected, ["torch.mm"])
    assert names["int8"] == [f"ttftc int8 GEMM: {int8_gemm_choice().gemm}"]  # the GEMM ttftc runs here
    meter.sample(2)
    peaks = meter.peaks()
    assert all(peaks[d].op in names[d] and peaks[d].gflops > 0 and peaks[d].samples == 2 for d in names)


def test_a_slow_gemm_is_timed_once_and_its_first_time_stands(monkeypatch):
    from ttftc.bench import roofline

    calls = []
    monkeypatch.setattr(roofline.PeakMeter, "_time", lambda self, fn, a, b: calls.append(fn) or 2.5)
    meter = roofline.PeakMeter(size=64, dtypes=("fp32",))
    meter.sample(3)
    peak = meter.peaks()["fp32"]
    assert len(calls) == len(meter._gemms["fp32"])  # the warm-ups only
    assert peak.gflops == 2.0 * 64**3 / 2.5 / 1e9 and peak.samples == 3
