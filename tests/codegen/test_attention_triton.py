"""The Triton FA2 kernel against the reference, under TRITON_INTERPRET=1 on CPU (tiny shapes: ~1000x slower).

Tolerances against the fp32 reference: fp32 inputs 1e-5 (the kernel uses IEEE fp32 dots and an exp2 online
softmax, so only summation order differs); fp16 2e-3 and bf16 2e-2 (tests/helpers.TOLERANCES: the output is
rounded to the input dtype).
"""

from __future__ import annotations

import pytest
import torch

import ttftc
from ttftc import zoo
from ttftc.codegen.lowering import LoweringContext
from ttftc.ops.attention import attention
from tests.helpers import TOLERANCES, assert_logits_match, compile_and_run, needs_transformers, needs_triton

pytestmark = [needs_triton, pytest.mark.interpreter]

FP32_TOL = (1e-5, 1e-5)
# Not head_dim**-0.5 (what a kernel would fall back to): a kernel that ignores `scale` fails every check.
SCALE = 0.3


def _triton():
    from ttftc.codegen.triton import attention as triton_attention

    return triton_attention


def _check(b, hq, hkv, sq, skv, d, *, causal, q_offset=0, window=0, dtype=torch.float32, kv_len=None, config=None,
           scale=SCALE):
    mod = _triton()
    gen = torch.Generator().manual_seed(sq * 131 + skv)
    q = torch.randn(b, hq, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, skv, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, skv, d, generator=gen).to(dtype)
    out = mod.launch(q, k, v, kv_len, causal=causal, scale=scale, q_offset=q_offset, window=window, config=config)
    expected = attention.reference(q.float(), k.float(), v.float(), kv_len, causal=causal, scale=scale,
                                   q_offset=q_offset, window=window)
    atol, rtol = FP32_TOL if dtype == torch.float32 else TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == (b, hq, sq, d)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("length", [1, 17, 127, 200])
@pytest.mark.parametrize("causal", [True, False])
def test_odd_lengths(length, causal):
    _check(1, 2, 2, length, length, 16, causal=causal)


@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_gqa_by_index_mapping(ratio):
    _check(1, 8, 8 // ratio, 37, 37, 16, causal=True)


@pytest.mark.parametrize("sq,skv", [(17, 40), (1, 33), (5, 5)])
def test_queries_start_inside_the_keys(sq, skv):
    _check(1, 2, 1, sq, skv, 16, causal=True, q_offset=skv - sq)


def test_q_offset_that_is_not_bottom_right():
    _check(1, 2, 2, 9, 30, 16, causal=True, q_offset=4)


@pytest.mark.parametrize("window", [1, 5, 40])
def test_sliding_window(window):
    _check(1, 2, 2, 70, 70, 16, causal=True, window=window)
    _check(1, 2, 2, 60, 70, 16, causal=True, q_offset=10, window=window)


def test_per_sequence_kv_len():
    _check(3, 2, 1, 33, 40, 16, causal=True, q_offset=7, kv_len=torch.tensor([40, 12, 0]))
    _check(2, 2, 2, 20, 20, 16, causal=False, kv_len=torch.tensor([3, 20]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(dtype):
    _check(1, 2, 1, 45, 45, 32, causal=True, dtype=dtype)
    _check(1, 2, 1, 30, 45, 32, causal=True, q_offset=15, dtype=dtype)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_production_head_dims(head_dim):
    _check(1, 1, 1, 19, 19, head_dim, causal=True, dtype=torch.float16, scale=head_dim ** -0.5)
    _check(1, 1, 1, 19, 23, head_dim, causal=True, q_offset=4, dtype=torch.float16)


def test_any_config_from_the_search_space_runs():
    mod = _triton()
    space = mod.candidate_configs(16, torch.float16)
    assert space and all(c.block_m <= 128 and c.block_n <= 64 for c in space)
    short = mod.candidate_configs(64, torch.float32, q_len=17)
    assert short and all(c.block_m <= 32 and c.block_n <= 64 for c in short)
    _check(1, 2, 2, 70, 70, 16, causal=True, config=mod.AttentionConfig(64, 32, 4, 2))


# -- capability ---------------------------------------------------------------------------------------------------


def _reason(ctx, q_shape=(1, 2, 8, 16), k_shape=(1, 2, 8, 16), v_shape=None, dtype=torch.float16, **kw):
    mod = _triton()
    q = torch.empty(q_shape, dtype=dtype, device="meta")
    k = torch.empty(k_shape, dtype=kw.pop("k_dtype", dtype), device="meta")
    v = torch.empty(v_shape or k_shape, dtype=dtype, device="meta")
    return mod._unsupported_reason(ctx, q, k, v, causal=True, scale=0.25, **kw)


FORCED_CPU = LoweringContext(device_type="cpu", forced_provider="triton")
CUDA = LoweringContext(device_type="cuda", forced_provider=None)


def test_capable_on_cuda_and_on_forced_interpreted_cpu():
    assert _reason(CUDA) is None
    assert _reason(FORCED_CPU) is None  # conftest sets TRITON_INTERPRET=1 without a GPU
    assert _reason(LoweringContext(device_type="cpu", forced_provider=None)) is not None
    assert _reason(LoweringContext(device_type="npu", forced_provider=None)) is not None


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(q_shape=(1, 2, 8, 512), k_shape=(1, 2, 8, 512)), "head dim"),
        (dict(k_dtype=torch.float32), "dtypes"),
        (dict(v_shape=(1, 2, 8, 32)), "head dims differ"),
        (dict(dtype=torch.float64), "dtypes"),
    ],
)
def test_bad_input_is_declined_with_a_reason(kwargs, fragment):
    reason = _reason(CUDA, **kwargs)
    assert reason is not None and fragment in reason


@needs_transformers
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_whole_zoo_model_runs_through_the_kernel(family):
    model = zoo.build(family, "sdpa")
    ids = zoo.example_ids(model, 9)
    actual, expected, report = compile_and_run(model, ids, ttftc.Config(passes=("attention",), provider="triton"))
    assert report.providers["attention"] == {"triton": model.config.num_hidden_layers}
    assert_logits_match(actual, expected)


@needs_transformers
def test_unsupported_head_dim_falls_back_to_the_reference():
    model = zoo.build("llama", "eager", hidden_size=1040, num_attention_heads=2, num_key_value_heads=2)  # D = 520
    ids = zoo.example_ids(model, 5)
    actual, expected, report = compile_and_run(model, ids, ttftc.Config(passes=("attention",), provider="triton"))
    assert report.providers["attention"] == {"reference": model.config.num_hidden_layers}
    assert any("head dim" in f for f in report.fallbacks)
    assert_logits_match(actual, expected)


# -- the persistent variant (triton-ascend's launch shape: grid = core count) ------------------------------------


def _check_persistent(b, hq, hkv, sq, skv, d, *, programs, block_m=16, block_n=16, causal=True, q_offset=0, window=0,
                      dtype=torch.float32, kv_len=None, scale=SCALE):
    mod = _triton()
    gen = torch.Generator().manual_seed(sq * 7 + programs)
    q = torch.randn(b, hq, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, skv, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, skv, d, generator=gen).to(dtype)
    out = mod.launch_persistent(q, k, v, kv_len, causal=causal, scale=scale, q_offset=q_offset, window=window,
                                block_m=block_m, block_n=block_n, programs=programs)
    expected = attention.reference(q.float(), k.float(), v.float(), kv_len, causal=causal, scale=scale,
                                   q_offset=q_offset, window=window)
    atol, rtol = FP32_TOL if dtype == torch.float32 else TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("programs", [1, 3, 20, 500])  # fewer, as many as and more programs than tiles
def test_persistent_kernel_covers_every_tile_once(programs):
    _check_persistent(2, 4, 2, 37, 37, 16, programs=programs)


@pytest.mark.parametrize("causal", [True, False])
def test_persistent_kernel_odd_lengths_and_gqa(causal):
    _check_persistent(1, 8, 2, 50, 50, 32, programs=7, block_m=32, block_n=16, causal=causal)


def test_persistent_kernel_window_offset_and_kv_len():
    _check_persistent(1, 2, 2, 70, 70, 16, programs=5, window=9)
    _check_persistent(1, 2, 2, 60, 70, 16, programs=5, q_offset=10, window=9)
    _check_persistent(3, 2, 1, 33, 40, 16, programs=4, q_offset=7, kv_len=torch.tensor([40, 12, 0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_persistent_kernel_half_precision(dtype):
    _check_persistent(1, 2, 1, 45, 45, 64, programs=3, block_m=32, block_n=32, dtype=dtype)
    _check_persistent(1, 2, 1, 30, 45, 64, programs=3, block_m=32, block_n=32, q_offset=15, dtype=dtype)


def test_persistent_kernel_needs_a_program():
    q = torch.zeros(1, 1, 4, 16)
    with pytest.raises(ValueError, match="at least one program"):
        _triton().launch_persistent(q, q, q, causal=True, scale=1.0, block_m=16, block_n=16, programs=0)


def test_npu_runs_the_triton_kernel_only_when_forced():
    assert _reason(LoweringContext(device_type="npu", forced_provider="triton")) is None
    assert "provider='triton'" in _reason(LoweringContext(device_type="npu", forced_provider=None))


def test_npu_default_comes_from_the_triton_ascend_space():
    from ttftc.codegen.lowering import load_providers
    from ttftc.codegen.triton.attention_ascend import ASCEND_TUNING_AXES

    load_providers()
    q = torch.empty(1, 8, 512, 64, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(1, 2, 512, 64, dtype=torch.bfloat16, device="meta")
    config = _triton()._npu_default(q, kv, kv, None, causal=True, scale=0.125, q_offset=0, window=0)
    assert set(config) == set(ASCEND_TUNING_AXES)
