"""The rope pass: Hugging Face's rotate-half RoPE (slices, neg, cat, two muls, add) fused into ttftc.rope."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import ttftc
from tests.helpers import assert_logits_match, needs_transformers
from tests.passes.ffn_norm_support import compile_capture, zoo_params
from ttftc import zoo
from ttftc.fx_utils import op_histogram
from ttftc.passes.rope import RopePass

LAYERS = 2  # the tiny zoo models
ROPE_FAMILIES = ("llama", "qwen2", "mistral", "phi3", "gemma")


@needs_transformers
@pytest.mark.parametrize("family,attn", zoo_params(ROPE_FAMILIES))
def test_rope_alone_fuses_q_and_k_of_every_layer_and_matches_eager(family, attn):
    model = zoo.build(family, attn)
    actual, expected, report, _ = compile_capture(model, zoo.example_ids(model, 9),
                                                  ttftc.Config(passes=("rope",), precision="fp32"))
    assert_logits_match(actual, expected)
    assert report.pass_counts["rope"] == 2 * LAYERS and report.rejections["rope"] == []
    before, after = report.ops_before, report.ops_after
    assert before["aten.neg"] == 2 * LAYERS and after.get("aten.neg", 0) == 0
    assert after["ttftc.rope"] == 2 * LAYERS


@needs_transformers
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_llama_with_every_pass_keeps_rope_fused(precision):
    model = zoo.build("llama", "sdpa")
    actual, expected, report, _ = compile_capture(model, zoo.example_ids(model, 9),
                                                  ttftc.Config(precision=precision))
    assert_logits_match(actual, expected, rel=1e-4 if precision == "fp32" else 3e-2)
    assert report.ops_after["ttftc.rope"] == 2 * LAYERS and report.ops_after["ttftc.attention"] == LAYERS


@needs_transformers
def test_a_model_without_rope_has_no_candidates():
    model = zoo.build("gpt2", "sdpa")
    _, _, report, _ = compile_capture(model, zoo.example_ids(model, 9), ttftc.Config(passes=("rope",)))
    assert report.pass_counts["rope"] == 0 and report.ops_after.get("ttftc.rope", 0) == 0


# -- the guard, on small traced graphs --------------------------------------------------------------------------

def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _inputs(dtype=torch.float32, cos_shape=(1, 1, 5, 8)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, 2, 8, generator=g).to(dtype).transpose(1, 2)
    return x, torch.randn(cos_shape, generator=g).to(dtype), torch.randn(cos_shape, generator=g).to(dtype)


def _run_pass(fn, *inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    stats = RopePass(ttftc.Config()).run(gm)
    return gm, stats


def hf_form(x, cos, sin):
    return (x * cos) + (_rotate_half(x) * sin)


def swapped_operands(x, cos, sin):
    return (sin * _rotate_half(x)) + (cos * x)


@pytest.mark.parametrize("fn,x_layout", [(hf_form, "bshd"), (hf_form, "contiguous"), (swapped_operands, "contiguous")])
def test_either_operand_order_is_fused_and_gives_the_same_numbers(fn, x_layout):
    inputs = _inputs()
    if x_layout == "contiguous":
        inputs = (inputs[0].contiguous(), *inputs[1:])
    gm, stats = _run_pass(fn, *inputs)
    assert (stats.candidates, stats.matched) == (1, 1)
    histogram = op_histogram(gm)
    assert histogram["ttftc.rope"] == 1 and not {"aten.neg", "aten.cat", "aten.mul", "aten.add"} & set(histogram)
    fused, eager = gm(*inputs), fn(*inputs)
    torch.testing.assert_close(fused, eager, atol=1e-6, rtol=1e-6)
    assert fused.stride() == eager.stride()


def test_a_sum_whose_traced_layout_is_not_the_ops_is_left_alone():
    # add(rotated * sin, x * cos) takes its layout from the rotated product (contiguous), while the fused op writes
    # x's memory order ([B, S, H, D] here): the views after it were traced for the former.
    gm, stats = _run_pass(swapped_operands, *_inputs())
    assert stats.matched == 0 and "traced layout" in stats.rejections[0]


def _not_halves(x, cos, sin):
    return x * cos + torch.cat((-x[..., 3:], x[..., :3]), dim=-1) * sin


def _extra_user(x, cos, sin):
    rotated = _rotate_half(x)
    return x * cos + rotated * sin, rotated


def _not_negated(x, cos, sin):
    return x * cos + torch.cat((x[..., 4:], x[..., :4]), dim=-1) * sin


def _other_tensor(x, cos, sin):
    return (x + 1) * cos + _rotate_half(x) * sin


def _along_another_dim(x, cos, sin):
    return x * cos + torch.cat((-x[:, :, 2:], x[:, :, :2]), dim=2) * sin


@pytest.mark.parametrize("fn,inputs,reason", [
    (_not_halves, _inputs(), "not the two halves"),
    (_extra_user, _inputs(), "users outside the pattern"),
    (_not_negated, _inputs(), "not mul(cat([neg"),
    (_other_tensor, _inputs(), "not slices of the tensor multiplied by cos"),
    (_along_another_dim, _inputs(), "not along the last dimension"),
    (hf_form, _inputs(cos_shape=(1, 1, 1, 8)), "does not broadcast"),  # one angle for every position
])
def test_the_guard_leaves_unproven_matches_alone(fn, inputs, reason):
    gm, stats = _run_pass(fn, *inputs)
    assert stats.matched == 0 and len(stats.rejections) == 1 and reason in stats.rejections[0]
    assert "ttftc.rope" not in op_histogram(gm)
    torch.testing.assert_close(gm(*inputs), fn(*inputs))


def test_mixed_dtypes_are_left_alone():
    x, cos, sin = _inputs()
    gm, stats = _run_pass(hf_form, x, cos.double(), sin.double())
    assert stats.matched == 0 and "dtypes differ" in stats.rejections[0]
