"""CPU lowerings of ttftc.gated_ffn and ttftc.linear_act against the op references, with the gated FFN's
act(gate)·up on the native row kernel and on ATen."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import ttftc
from tests.helpers import TOLERANCES, assert_logits_match, needs_transformers
from ttftc import zoo
from tests.codegen.conftest import GEMM_TUNINGS, fp32_gemm_options_or_skip, record_linear_2d, switch_native
from ttftc.codegen.cpu import ffn as cpu_ffn
from ttftc.codegen.cpu.ffn import gated_ffn_cpu, linear_act_cpu
from ttftc.codegen.lowering import lower_graph
from ttftc.codegen.registry import LoweringContext, lowerings_for
from ttftc.ops.ffn import ACTIVATIONS

gated_ffn, linear_act = torch.ops.ttftc.gated_ffn, torch.ops.ttftc.linear_act

CPU = LoweringContext("cpu", None)


def _weights(dtype, hidden=24, inter=40, bias=False):
    g = torch.Generator().manual_seed(0)
    w_gate_up = (torch.randn(2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w_down = (torch.randn(hidden, inter, generator=g) * 0.2).to(dtype)
    b_gate_up = torch.randn(2 * inter, generator=g).to(dtype) if bias else None
    b_down = torch.randn(hidden, generator=g).to(dtype) if bias else None
    x = torch.randn(2, 5, hidden, generator=g).to(dtype)
    return x, w_gate_up, w_down, b_gate_up, b_down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("glue", ["native", "aten"])
def test_gated_ffn_cpu_matches_reference(monkeypatch, dtype, act, bias, glue):
    calls = switch_native(monkeypatch, glue, [cpu_ffn], ("gated_act",))
    x, w_gu, w_d, b_gu, b_d = _weights(dtype, bias=bias)
    expected = gated_ffn(x, w_gu, w_d, b_gu, b_d, act=act)
    actual = gated_ffn_cpu(x, w_gu, w_d, b_gu, b_d, act=act)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    # the native kernel takes every activation but exact gelu (erf), which stays on ATen
    assert calls == (["gated_act"] if glue == "native" and act != "gelu" else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_linear_act_cpu_matches_reference(dtype, act):
    x, w, _, b, _ = _weights(dtype, bias=True)
    expected = linear_act(x, w, b, act=act)
    actual = linear_act_cpu(x, w, b, act=act)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def test_lowering_keeps_the_frozen_weights_without_copies():
    x, w_gu, w_d, _, _ = _weights(torch.float32)
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    gm.register_buffer("w_gate_up", w_gu)
    gm.register_buffer("w_down", w_d)
    graph = gm.graph
    inp = graph.placeholder("x")
    inp.meta["val"] = x
    wgu_node, wd_node = graph.get_attr("w_gate_up"), graph.get_attr("w_down")
    wgu_node.meta["val"], wd_node.meta["val"] = w_gu, w_d
    out = graph.call_function(torch.ops.ttftc.gated_ffn.default, (inp, wgu_node, wd_node), {"act": "silu"})
    out.meta["val"] = gated_ffn(x, w_gu, w_d, act="silu")
    graph.output(out)
    gm.recompile()
    (decision,) = lower_graph(gm, provider="cpu")
    assert decision.provider == "cpu" and out.target is gated_ffn_cpu
    assert out.args[1] is wgu_node and sorted(dict(gm.named_buffers())) == ["w_down", "w_gate_up"]
    torch.testing.assert_close(gm(x), gated_ffn(x, w_gu, w_d, act="silu"))


def test_capability_reasons():
    (entry,) = [e for e in lowerings_for("gated_ffn") if e.provider == "cpu"]
    x, w_gu, w_d, _, _ = _weights(torch.float32)
    assert entry.unsupported_reason(CPU, x, w_gu, w_d, act="silu") is None
    assert "cuda" in entry.unsupported_reason(LoweringContext("cuda", None), x, w_gu, w_d, act="silu")
    assert "float64" in entry.unsupported_reason(CPU, x.double(), w_gu.double(), w_d.double(), act="silu")
    assert "gated FFN" in entry.unsupported_reason(CPU, x, w_gu[:-1], w_d, act="silu")


@needs_transformers
def test_zoo_llama_runs_through_the_cpu_lowerings():
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 9)
    backend = ttftc.backend(ttftc.Config(provider="cpu"))
    with torch.no_grad():
        assert_logits_match(torch.compile(model, backend=backend)(ids).logits, model(ids).logits)
    providers = backend.report().providers
    assert providers["gated_ffn"] == {"cpu": 2}
    assert providers["norm_linear"] == {"cpu": 3} and providers["norm"] == {"cpu": 2}


@pytest.mark.parametrize("n_block", [0, 5, 16, 1000])
def test_column_blocked_gemm_is_exact_with_and_without_bias(n_block):
    from ttftc.codegen.cpu._blas import linear_2d

    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 12, generator=gen), torch.randn(37, 12, generator=gen), torch.randn(37, generator=gen)
    torch.testing.assert_close(linear_2d(x, w, None, n_block), x @ w.t())
    torch.testing.assert_close(linear_2d(x, w, b, n_block), torch.addmm(b, x, w.t()))


def test_cpu_gemm_ops_expose_the_backend_and_column_block_knobs():
    from ttftc.autotune.space import space_for

    for op in ("gated_ffn", "linear_act", "norm_linear", "linear"):
        axes = space_for(op, "cpu").axes
        assert axes["n_block"] == (0, 512, 1024, 2048) and axes["gemm"] == ("onednn", "blas")


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activations_run_in_place_and_match_torch(act):
    from ttftc.codegen.cpu.ffn import activation_

    x = torch.randn(4, 9)
    expected = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu,
                "relu": F.relu}[act](x)
    buffer = x.clone()
    out = activation_(buffer, act)
    assert out.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(out, expected)


def test_an_unknown_activation_is_refused_by_name():
    from ttftc.codegen.cpu.ffn import activation_

    with pytest.raises(ValueError, match="Unknown activation 'swish'"):
        activation_(torch.randn(2), "swish")


def test_every_gated_and_linear_act_refusal():
    (gated,) = [e for e in lowerings_for("gated_ffn") if e.provider == "cpu"]
    (linear,) = [e for e in lowerings_for("linear_act") if e.provider == "cpu"]
    x, w_gu, w_d, b_gu, b_d = _weights(torch.float32, bias=True)
    assert gated.unsupported_reason(CPU, x, w_gu, w_d, b_gu, b_d, act="gelu") is None
    assert "activation 'swish'" in gated.unsupported_reason(CPU, x, w_gu, w_d, act="swish")
    assert "gated FFN" in gated.unsupported_reason(CPU, x, w_gu, w_d[:, :-1], act="silu")
    assert "gated FFN" in gated.unsupported_reason(CPU, x, w_gu[:, :-1], w_d, act="silu")
    assert "bias of shape (3,)" in gated.unsupported_reason(CPU, x, w_gu, w_d, b_gu[:3], act="silu")
    assert "bias of shape (3,)" in gated.unsupported_reason(CPU, x, w_gu, w_d, b_gu, b_d[:3], act="silu")
    assert "bias of shape" in gated.unsupported_reason(CPU, x, w_gu, w_d, b_gu[None], act="silu")
    assert "bias of shape" in gated.unsupported_reason(CPU, x, w_gu, w_d, b_gu.half(), act="silu")
    assert "weight dtype" in gated.unsupported_reason(CPU, x, w_gu, w_d.half(), act="silu")
    # each operand's dtype is checked: the activation's, then each weight against it
    assert gated.unsupported_reason(CPU, x.double(), w_gu, w_d, act="silu") == (
        "dtype torch.float64 not supported by the cpu GEMM path")
    assert gated.unsupported_reason(CPU, x, w_gu.half(), w_d, act="silu") == (
        "weight dtype torch.float16 differs from activation dtype torch.float32")
    # an odd hidden width is fine; an odd gate|up height is not
    assert gated.unsupported_reason(CPU, x[..., :7], w_gu[:, :7], w_d, act="silu") is None
    assert gated.unsupported_reason(CPU, x, w_gu[:-1], w_d, act="silu") == (
        f"weights ({w_gu.shape[0] - 1}, {w_gu.shape[1]}) / {tuple(w_d.shape)} do not form a gated FFN")
    assert linear.unsupported_reason(CPU, x, w_gu, b_gu, act="relu") is None
    assert "activation 'swish'" in linear.unsupported_reason(CPU, x, w_gu, act="swish")
    assert "does not fit input width" in linear.unsupported_reason(CPU, x, w_gu[:, :-1], act="relu")
    assert "bias of shape" in linear.unsupported_reason(CPU, x, w_gu, b_gu[:3], act="relu")
    assert "tensors on cuda" in linear.unsupported_reason(LoweringContext("cuda", None), x, w_gu, act="relu")


def test_linear_act_refusals_check_both_operands_and_name_the_input_width():
    (linear,) = [e for e in lowerings_for("linear_act") if e.provider == "cpu"]
    x, w, _, _, _ = _weights(torch.float32)  # x is [2, 5, 24]: the width is the last dim, not a batch dim
    assert linear.unsupported_reason(CPU, x, w[:, :-1], act="relu") == "weight (80, 23) does not fit input width 24"
    assert linear.unsupported_reason(CPU, x, w.half(), act="relu") == (
        "weight dtype torch.float16 differs from activation dtype torch.float32")
    assert linear.unsupported_reason(CPU, x.double(), w, act="relu") == (
        "dtype torch.float64 not supported by the cpu GEMM path")


@pytest.mark.parametrize("tuning", [{"gemm": "blas", "n_block": 16}, {"gemm": "blas", "n_block": 0},
                                    {"gemm": "onednn", "n_block": 0}, {"num_threads": 1}])
def test_every_gemm_config_gives_the_reference_numbers(tuning):
    x, w_gu, w_d, b_gu, b_d = _weights(torch.float32, bias=True)
    torch.testing.assert_close(gated_ffn_cpu(x, w_gu, w_d, b_gu, b_d, act="silu", tuning_config=tuning),
                               gated_ffn(x, w_gu, w_d, b_gu, b_d, act="silu"), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear_act_cpu(x, w_gu, b_gu, act="gelu", tuning_config=tuning),
                               linear_act(x, w_gu, b_gu, act="gelu"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tuning", GEMM_TUNINGS)
def test_the_ffn_gemms_run_with_the_tuned_options_else_the_dtypes_defaults(monkeypatch, tuning):
    options = fp32_gemm_options_or_skip(tuning)
    calls = record_linear_2d(monkeypatch, cpu_ffn)
    x, w_gu, w_d, b_gu, b_d = _weights(torch.float32, bias=True)
    gated_ffn_cpu(x, w_gu, w_d, b_gu, b_d, act="silu", tuning_config=tuning)
    # the down projection takes the tuned backend only, without column blocks
    assert calls == [options, {"gemm": options["gemm"], "n_block": 0}]
    calls.clear()
    linear_act_cpu(x, w_gu, b_gu, act="gelu", tuning_config=tuning)
    assert calls == [options]
