"""The precision pass: bf16 and W8A8 int8 rewrites, the skip list, refusals, device fallback, and fusion of
quant-dequant patterns already in a graph (torch.ao PT2E, torchao's _int_mm chains)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import ttftc
from tests.helpers import needs_transformers
from ttftc import zoo
from ttftc.capabilities import Capabilities
from ttftc.passes import _bf16_rewrite
from ttftc.passes import precision as precision_pass

pytestmark = needs_transformers


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


BF16, FP32, INT8 = torch.bfloat16, torch.float32, torch.int8
# An int8 GEMM reads an activation quantised by its producer, or quantises a float one in its own prologue (the
# o_proj after attention, a lone consumer); its weight is int8 either way.
INT8_GEMM = {(INT8, INT8), (FP32, INT8)}
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
# The operands whose dtype is the precision a GEMM or an attention runs in: (activation, weight) or (q, k, v).
_COMPUTE_OPERANDS = {
    "aten.mm": lambda n: n.args[:2], "aten.addmm": lambda n: n.args[1:3], "aten.bmm": lambda n: n.args[:2],
    "sdpa": lambda n: n.args[:3], "attention": lambda n: n.args[:3],
    "linear": lambda n: n.args[:2], "linear_act": lambda n: n.args[:2], "gated_ffn": lambda n: n.args[:3],
    "norm_linear": lambda n: (n.args[0], n.args[3]), "int8_linear": lambda n: (n.args[0], n.args[2]),
    "gated_ffn_int8": lambda n: (n.args[0], n.args[2], n.args[4]),
}


def _label(node) -> str | None:
    if node.op != "call_function":
        return None
    if node.meta.get("ttftc_op"):
        return node.meta["ttftc_op"]
    if node.target is _FLASH_CPU:
        return "sdpa"
    name = f"aten.{node.target.__name__.split('.')[0]}" if hasattr(node.target, "__name__") else None
    return name if name in _COMPUTE_OPERANDS else None


def compute_dtypes(backend) -> dict[str, set[tuple]]:
    """For every GEMM and attention op in the lowered graphs: the set of its operands' dtypes (one tuple per op)."""
    found: dict[str, set[tuple]] = {}
    for gm in backend.graph_modules:
        for node in gm.graph.nodes:
            label = _label(node)
            if label in _COMPUTE_OPERANDS:
                dtypes = tuple(a.meta["val"].dtype for a in _COMPUTE_OPERANDS[label](node))
                found.setdefault(label, set()).add(dtypes)
    return found


def run(model, config, length=24):
    """(compiled logits, eager logits, report, compute_dtypes of the lowered graphs)."""
    ids = zoo.example_ids(model, length)
    backend = ttftc.backend(config)
    with torch.no_grad():
        expected = model(ids).logits
        actual = torch.compile(model, backend=backend)(ids).logits
    return actual, expected, backend.report(), compute_dtypes(backend)


def test_fp32_leaves_the_graph_alone():
    model = zoo.build("llama", "sdpa")
    actual, expected, report, dtypes = run(model, ttftc.Config(precision="fp32", passes=("precision",)))
    assert report.pass_counts["precision"] == 0
    assert report.ops_after == report.ops_before
    assert dtypes == {"aten.mm": {(FP32, FP32)}, "sdpa": {(FP32, FP32, FP32)}}
    torch.testing.assert_close(actual, expected)


def test_bf16_plain_graph_casts_every_gemm_and_keeps_fp32_logits():
    model = zoo.build("llama", "sdpa")
    actual, expected, report, dtypes = run(model, ttftc.Config(precision="bf16", passes=("precision",)))
    # 2 layers x 7 linears + lm_head, and 2 SDPA calls.
    assert report.pass_counts["precision"] == 17
    assert report.ops_after["aten.mm"] == report.ops_before["aten.mm"] == 15
    assert dtypes == {"aten.mm": {(BF16, BF16)}, "sdpa": {(BF16, BF16, BF16)}}
    assert actual.dtype == torch.float32
    assert cosine(actual, expected) >= 0.999


def test_int8_plain_graph_quantises_linears_but_not_the_lm_head():
    model = zoo.build("llama", "sdpa")
    actual, expected, report, dtypes = run(model, ttftc.Config(precision="int8", passes=("precision",)))
    assert report.ops_after["ttftc.int8_linear"] == 14
    assert report.ops_after["aten.mm"] == 1  # the lm_head, kept in the float policy (fp32: bf16 is not native)
    # Every int8 GEMM reads an activation quantised by the shared quantize_per_token, and an int8 weight.
    assert dtypes == {"int8_linear": INT8_GEMM, "aten.mm": {(FP32, FP32)}, "sdpa": {(FP32, FP32, FP32)}}
    # q, k, v read one activation and share one quantisation; so do gate and up.
    assert report.ops_after["ttftc.quantize_per_token"] == 4
    assert any("lm_head" in r and "quant_skip" in r for r in report.rejections["precision"])
    assert cosine(actual, expected) >= 0.99


def test_int8_with_fused_ops_uses_the_int8_variants():
    model = zoo.build("llama", "sdpa")
    actual, expected, report, dtypes = run(model, ttftc.Config(precision="int8"))
    after = report.ops_after
    assert after.get("ttftc.gated_ffn", 0) == 0 and after["ttftc.gated_ffn_int8"] == 2
    assert dtypes == {"gated_ffn_int8": {(INT8, INT8, INT8)}, "int8_linear": INT8_GEMM,
                      "norm_linear": {(FP32, FP32)}, "attention": {(FP32, FP32, FP32)}}
    # q/k/v norm_linear x2 and the final norm feeding the lm_head: the latter stays a (bf16) norm_linear.
    assert after["ttftc.norm_linear"] == 1
    # Each layer: the input norm (norm_linear) and the post-attention norm (ttftc.norm) now quantise.
    assert after["ttftc.norm_quant"] == 4 and after.get("ttftc.norm", 0) == 0
    assert after["ttftc.int8_linear"] == 4  # q/k/v merged and o_proj, per layer
    assert report.providers["gated_ffn_int8"] == {"cpu": 2}
    assert cosine(actual, expected) >= 0.99


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_zoo_logits_cosine(family, precision):
    model = zoo.build(family, "sdpa")
    actual, expected, report, dtypes = run(model, ttftc.Config(precision=precision))
    assert report.pass_counts["precision"] > 0 and not report.errors
    assert actual.dtype == torch.float32
    operands = {dtype for per_op in dtypes.values() for op_dtypes in per_op for dtype in op_dtypes}
    if precision == "bf16":  # every GEMM and attention, the lm_head included
        assert operands == {BF16}, dtypes
    else:  # int8 GEMMs; the rest in the float policy, fp32 where bf16 is not native (as the tests pin it)
        assert dtypes["int8_linear"] == INT8_GEMM and dtypes["attention"] == {(FP32, FP32, FP32)}, dtypes
        assert dtypes.get("gated_ffn_int8", {(INT8, INT8, INT8)}) == {(INT8, INT8, INT8)}, dtypes
        assert operands == {INT8, FP32}, dtypes
    assert cosine(actual, expected) >= 0.99


@pytest.mark.slow
@pytest.mark.parametrize("family", ["phi3", "gemma"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_more_zoo_logits_cosine(family, attn, precision):
    model = zoo.build(family, attn)
    actual, expected, report, dtypes = run(model, ttftc.Config(precision=precision))
    assert not report.errors
    assert cosine(actual, expected) >= 0.99
    float_operands = {d for per_op in dtypes.values() for op_dtypes in per_op for d in op_dtypes if d != INT8}
    assert float_operands == ({BF16} if precision == "bf16" else {FP32}), dtypes


def test_eager_attention_bmm_runs_bf16():
    model = zoo.build("llama", "eager")
    actual, expected, report, dtypes = run(model, ttftc.Config(precision="bf16", passes=("precision",)))
    assert report.ops_after["aten.bmm"] == report.ops_before["aten.bmm"] == 4
    assert report.pass_counts["precision"] == 15 + 4
    # q·kᵀ and probabilities·v both run in bf16, as do all 15 linears.
    assert dtypes == {"aten.bmm": {(BF16, BF16)}, "aten.mm": {(BF16, BF16)}}
    assert cosine(actual, expected) >= 0.999


def test_skip_list_keeps_named_layers_out_of_int8():
    model = zoo.build("llama", "sdpa")
    config = ttftc.Config(precision="int8", passes=("precision",), quant_skip=("lm_head", "layers.1.", "down_proj"))
    actual, _, report, dtypes = run(model, config)
    # Layer 0 keeps q, k, v, o, gate, up (6); layer 1 and both down_proj are skipped.
    assert report.ops_after["ttftc.int8_linear"] == 6
    assert dtypes["int8_linear"] == INT8_GEMM and dtypes["aten.mm"] == {(FP32, FP32)}  # skipped: float policy
    skipped = [r for r in report.rejections["precision"] if "quant_skip" in r]
    assert len(skipped) == 1 + 7 + 1
    assert any("model.layers.1.self_attn.q_proj" in r for r in skipped)
    assert torch.isfinite(actual).all()


def test_skip_list_names_fused_nodes_by_the_layers_they_feed():
    model = zoo.build("llama", "sdpa")
    _, _, report, dtypes = run(model, ttftc.Config(precision="int8", quant_skip=("lm_head", "layers.0.mlp")))
    assert report.ops_after["ttftc.gated_ffn_int8"] == 1
    assert dtypes["gated_ffn"] == {(FP32, FP32, FP32)} and dtypes["gated_ffn_int8"] == {(INT8, INT8, INT8)}
    # Named by their own nn_module_stack when the fusing pass kept it, else by the layers their outputs feed.
    assert any(r.startswith("model.layers.0.mlp.down_proj") and "quant_skip" in r for r in report.rejections["precision"])


@pytest.fixture
def native_bf16(monkeypatch):
    """A device with native bf16, so int8 keeps what it refuses in bf16 (tests pin the probe to "not native")."""
    caps = Capabilities("cpu", "test CPU with bf16", True, "mocked", True, False)
    monkeypatch.setattr(precision_pass, "probe", lambda device="cpu": caps)


def test_nan_weights_are_refused_for_that_layer_only(native_bf16):
    model = zoo.build("llama", "sdpa")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    _, _, report, dtypes = run(model, ttftc.Config(precision="int8", passes=("precision",)))
    refusals = [r for r in report.rejections["precision"] if "NaN" in r]
    assert refusals == ["model.layers.1.mlp.up_proj: int8 refused: weights contain NaN or inf; kept bf16"]
    assert report.ops_after["ttftc.int8_linear"] == 13
    # The refused up_proj and the skipped lm_head run bf16, as does attention (bf16 is native here).
    assert dtypes == {"int8_linear": INT8_GEMM | {(BF16, INT8)}, "aten.mm": {(BF16, BF16)},
                      "sdpa": {(BF16, BF16, BF16)}}


def test_unsupported_shapes_are_refused_with_a_reason():
    model = zoo.build("llama", "sdpa", intermediate_size=100)  # 100 is not a multiple of 8
    actual, expected, report, dtypes = run(model, ttftc.Config(precision="int8"))
    assert report.ops_after.get("ttftc.gated_ffn_int8", 0) == 0
    assert dtypes["gated_ffn"] == {(FP32, FP32, FP32)}  # refused: the float policy (fp32 here)
    reasons = [r for r in report.rejections["precision"] if "unsupported by the int8 kernels" in r]
    assert len(reasons) == 2 and all(r.startswith("model.layers.") for r in reasons)
    assert cosine(actual, expected) >= 0.99


def test_int8_without_an_int8_path_falls_back_to_bf16_with_a_warning(monkeypatch, native_bf16):
    monkeypatch.setattr(precision_pass, "int8_unavailable_reason", lambda device: "no int8 here")
    model = zoo.build("llama", "sdpa")
    with pytest.warns(RuntimeWarning, match="falling back to bf16"):
        actual, expected, report, dtypes = run(model, ttftc.Config(precision="int8", passes=("precision",)))
    assert "ttftc.int8_linear" not in report.ops_after
    assert report.pass_counts["precision"] == 17
    assert dtypes == {"aten.mm": {(BF16, BF16)}, "sdpa": {(BF16, BF16, BF16)}}
    assert cosine(actual, expected) >= 0.999


# -- quant-dequant patterns already in a graph ---------------------------------------------------------------


def _quantize_weight(out_features: int, in_features: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.1
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


class Pt2eLinear(torch.nn.Module):
    """What convert_pt2e leaves for a statically quantised linear (symmetric int8, per-channel weights)."""

    def __init__(self, zero_point: int = 0):
        super().__init__()
        w_q, w_s = _quantize_weight(32, 64)
        self.register_buffer("w_q", w_q)
        self.register_buffer("w_s", w_s)
        self.register_buffer("w_zp", torch.zeros(32, dtype=torch.int64))
        self.bias = torch.nn.Parameter(torch.randn(32) * 0.1)
        self.zero_point = zero_point

    def forward(self, x):
        import torch.ao.quantization.fx._decomposed  # noqa: F401

        qd = torch.ops.quantized_decomposed
        x_q = qd.quantize_per_tensor(x, 0.02, self.zero_point, -128, 127, torch.int8)
        x_dq = qd.dequantize_per_tensor(x_q, 0.02, self.zero_point, -128, 127, torch.int8)
        w_dq = qd.dequantize_per_channel(self.w_q, self.w_s, self.w_zp, 0, -128, 127, torch.int8)
        return F.linear(x_dq, w_dq, self.bias)


def _compile(module, x, config):
    backend = ttftc.backend(config)
    with torch.no_grad():
        expected = module(x)
        actual = torch.compile(module, backend=backend)(x)
    return actual, expected, backend.report(), compute_dtypes(backend)


def test_pt2e_quant_dequant_linear_fuses_into_int8_linear():
    x = torch.randn(2, 20, 64)
    actual, expected, report, dtypes = _compile(Pt2eLinear(), x, ttftc.Config(precision="int8"))
    assert report.ops_before["quantized_decomposed.dequantize_per_channel"] == 1
    assert report.ops_after["ttftc.int8_linear"] == 1
    assert dtypes == {"int8_linear": {(INT8, INT8)}}  # the graph's own int8 activation, no float GEMM left
    assert "quantized_decomposed.dequantize_per_channel" not in report.ops_after
    assert "quantized_decomposed.dequantize_per_tensor" not in report.ops_after
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_pt2e_asymmetric_pattern_is_refused():
    x = torch.randn(2, 20, 64)
    actual, expected, report, dtypes = _compile(Pt2eLinear(zero_point=3), x, ttftc.Config(precision="int8"))
    assert "ttftc.int8_linear" not in report.ops_after
    assert dtypes == {"aten.addmm": {(FP32, FP32)}}  # the dequantised pattern, left as the graph wrote it
    assert any("asymmetric" in r for r in report.rejections["precision"])
    torch.testing.assert_close(actual, expected)


class TorchaoStyleLinear(torch.nn.Module):
    """torchao's W8A8-dynamic after desugaring: per-token quantisation, _int_mm, then the two scale multiplies."""

    def __init__(self):
        super().__init__()
        w_q, w_s = _quantize_weight(48, 64, seed=1)
        self.register_buffer("w_q", w_q)
        self.register_buffer("w_s", w_s)

    def forward(self, x):
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
        x_q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
        return torch._int_mm(x_q, self.w_q.t()).to(torch.float32) * scale * self.w_s


def _exact_int32_product(a, b):
    return (a.long() @ b.long()).to(torch.int32)  # |a·b| <= 127 · 128 · K fits int32 for every K here


def test_torchao_int_mm_chain_fuses_into_int8_linear(monkeypatch):
    x = torch.randn(24, 64)
    module = TorchaoStyleLinear()
    actual, _, report, dtypes = _compile(module, x, ttftc.Config(precision="int8"))
    # The reference is the module with _int_mm's exact int32 product: _int_mm itself is no oracle where oneDNN runs
    # it with AVX2's u8s8 dot products (ONEDNN_MAX_CPU_ISA=AVX2 on a VNNI CPU), whose int16 sums saturate.
    with monkeypatch.context() as exact:
        exact.setattr(torch, "_int_mm", _exact_int32_product)
        expected = module(x)
    assert dtypes == {"int8_linear": {(INT8, INT8)}}
    assert report.ops_before["aten._int_mm"] == 1
    assert report.ops_after["ttftc.int8_linear"] == 1 and "aten._int_mm" not in report.ops_after
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_bf16_round_trips_through_views_are_elided():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(y):
        widened = y.to(torch.float32).view(4, 2, 8).transpose(0, 1)
        return widened.to(torch.bfloat16) * 2, widened.sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 8, dtype=torch.bfloat16))
    casts = lambda: [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]  # noqa: E731
    assert len(casts()) == 2
    _bf16_rewrite.elide_round_trips(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    # The narrowing cast is gone; the widening one stays for the fp32 reader (sum).
    assert [n.kwargs["dtype"] for n in casts()] == [torch.float32]
    y = torch.randn(8, 8, dtype=torch.bfloat16)
    for got, want in zip(gm(y), f(y)):
        torch.testing.assert_close(got, want)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_real_torchao_w8a8_linear_fuses_into_int8_linear():
    # torchao's CPU form: x_q + 128 as uint8 into _int_mm, a column-sum correction, then the scales and bias;
    # its weights are tensor subclasses, so they reach the graph as live inputs rather than frozen constants.
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    module = torch.nn.Sequential(torch.nn.Linear(64, 48)).eval()
    quantize_(module, Int8DynamicActivationInt8WeightConfig())
    actual, expected, report, dtypes = _compile(module, torch.randn(24, 64), ttftc.Config(precision="int8"))
    assert dtypes == {"int8_linear": {(INT8, INT8)}}
    assert report.ops_before["aten._int_mm"] == 1
    assert report.ops_after["ttftc.int8_linear"] == 1 and "aten._int_mm" not in report.ops_after
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_bf16_applies_when_sdpa_carries_an_explicit_mask():
    """With use_cache=False transformers hands SDPA an explicit mask (its packed-sequence check); the bf16 rewrite
    of that SDPA must cast the mask node too (it once crashed here and the whole pass was rolled back)."""
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 16)
    backend = ttftc.backend(ttftc.Config(precision="bf16"))
    with torch.inference_mode():
        expected = model(ids, use_cache=False).logits
        actual = torch.compile(model, backend=backend)(ids, use_cache=False).logits
    report = backend.report()
    assert "precision" not in report.errors
    assert report.pass_counts["precision"] > 0
    dtypes = compute_dtypes(backend)
    assert {d for per_op in dtypes.values() for op_dtypes in per_op for d in op_dtypes} == {BF16}, dtypes
    cosine = torch.nn.functional.cosine_similarity(actual.flatten(), expected.flatten(), dim=0)
    assert cosine >= 0.99
