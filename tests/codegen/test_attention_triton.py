"""The Triton FA2 kernel against the reference, under TRITON_INTERPRET=1 on CPU (tiny shapes: ~1000x slower).

Tolerances against the fp32 reference: fp32 inputs 1e-5 (the kernel uses IEEE fp32 dots and an exp2 online
softmax, so only summation order differs); fp16 2e-3 and bf16 2e-2 (tests/helpers.TOLERANCES: the output is
rounded to the input dtype).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ttftc
from ttftc import zoo
from ttftc.codegen.registry import LoweringContext
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
    import ttftc.codegen.providers  # noqa: F401  (registers the triton-ascend space)
    from ttftc.codegen.triton.attention_ascend import ASCEND_TUNING_AXES

    q = torch.empty(1, 8, 512, 64, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(1, 2, 512, 64, dtype=torch.bfloat16, device="meta")
    config = _triton()._npu_default(q, kv, kv, None, causal=True, scale=0.125, q_offset=0, window=0)
    assert set(config) == set(ASCEND_TUNING_AXES)


# -- host-side rules and launch data (no kernel runs) -------------------------------------------------------------


def _target(name):
    from ttftc.codegen.triton.targets import get_target

    return get_target(name)


def _cfg(bm, bn, warps, stages):
    return dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)


def test_padded_head_dim_is_the_next_power_of_two_and_at_least_16():
    mod = _triton()
    assert [mod.padded_head_dim(d) for d in (1, 8, 16, 17, 32, 33, 64, 80, 96, 128, 129)] == \
        [16, 16, 16, 32, 32, 64, 64, 128, 128, 128, 256]


def test_next_pow2_rounds_up_and_maps_zero_and_one_to_one():
    mod = _triton()
    assert [mod.triton_next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 17, 64, 65)] == [1, 1, 2, 4, 4, 8, 32, 64, 128]


def test_register_rule_counts_score_and_accumulator_values_per_lane():
    mod = _triton()
    sm80, gfx = _target("sm_80"), _target("gfx942")
    # cuda, 16-bit: (128*64 + 128*64) / (32*4) = 128 values per lane is exactly the limit, not over it.
    assert mod.register_reason(_cfg(128, 64, 4, 3), 64, torch.float16, sm80) is None
    assert mod.register_reason(_cfg(128, 128, 4, 1), 64, torch.float16, sm80) == \
        "192 fp32 score and accumulator values per lane (over 128) spill registers"
    # No target: a 32-lane-warp cuda device.
    assert mod.register_reason(_cfg(128, 128, 4, 1), 64, torch.float16, None) == \
        "192 fp32 score and accumulator values per lane (over 128) spill registers"
    assert mod.register_reason(_cfg(128, 64, 4, 3), 64, torch.float16, None) is None
    # The accumulator counts the padded head dim: 80 pads to 128, (64*16 + 64*128) / 128 = 72.
    assert mod.register_reason(_cfg(64, 16, 4, 1), 80, torch.float32, sm80) == \
        "72 fp32 score and accumulator values per lane (over 24) spill registers"
    # fp32: 24 per lane, reached exactly by (32*32 + 32*64) / 128.
    assert mod.register_reason(_cfg(32, 32, 4, 1), 64, torch.float32, sm80) is None
    assert mod.register_reason(_cfg(32, 64, 4, 1), 16, torch.float32, sm80) is None
    assert mod.register_reason(_cfg(32, 64, 4, 1), 64, torch.float32, None) == \
        "32 fp32 score and accumulator values per lane (over 24) spill registers"
    # hip: 64-lane warps and 96 values: (128*64 + 128*64) / 256 = 64; (128*128 + 128*128) / 256 = 128 > 96.
    assert mod.register_reason(_cfg(128, 64, 4, 2), 64, torch.float16, gfx) is None
    assert mod.register_reason(_cfg(128, 128, 4, 1), 128, torch.float16, gfx) == \
        "128 fp32 score and accumulator values per lane (over 96) spill registers"
    # (64*32 + 64*128) / 256 = 40 > 24 on hip fp32 as well; the 96 is for 16-bit inputs only.
    assert mod.register_reason(_cfg(64, 32, 4, 1), 128, torch.float32, gfx) == \
        "40 fp32 score and accumulator values per lane (over 24) spill registers"
    # A backend without its own budget gets NVIDIA's 128 values per lane: 16 * (240 + 16) / 32 = 128, then 129.
    other = dataclasses.replace(sm80, name="other", backend="other")
    assert mod.register_reason(_cfg(16, 240, 1, 1), 16, torch.float16, other) is None
    assert mod.register_reason(_cfg(16, 242, 1, 1), 16, torch.float16, other) == \
        "129 fp32 score and accumulator values per lane (over 128) spill registers"


def test_register_rule_on_hip_prunes_wide_deep_tiles_of_8_warps():
    mod = _triton()
    gfx, sm80 = _target("gfx942"), _target("sm_80")
    wide = "8 wave64 warps have 256 VGPRs per lane: K/V tiles this wide and deep spill"
    deep = "128-wide K/V tiles of a 128-wide head, 4 stages deep, spill"
    assert mod.register_reason(_cfg(16, 128, 8, 1), 16, torch.float16, gfx) == wide
    assert mod.register_reason(_cfg(16, 64, 8, 3), 16, torch.float16, gfx) == wide
    assert mod.register_reason(_cfg(16, 64, 8, 2), 16, torch.float16, gfx) is None
    assert mod.register_reason(_cfg(16, 32, 8, 4), 16, torch.float16, gfx) is None
    assert mod.register_reason(_cfg(16, 64, 4, 4), 16, torch.float16, gfx) is None
    assert mod.register_reason(_cfg(16, 128, 4, 4), 128, torch.float16, gfx) == deep
    assert mod.register_reason(_cfg(16, 128, 4, 3), 128, torch.float16, gfx) is None
    assert mod.register_reason(_cfg(16, 128, 4, 4), 64, torch.float16, gfx) is None
    assert mod.register_reason(_cfg(16, 64, 4, 4), 128, torch.float16, gfx) is None
    # The hip rules are not NVIDIA's.
    assert mod.register_reason(_cfg(16, 128, 8, 4), 128, torch.float16, sm80) is None


def test_shared_memory_bound_per_backend():
    mod = _triton()
    sm80, gfx = _target("sm_80"), _target("gfx942")
    # NVIDIA: (BLOCK_M + 2 * BLOCK_N * stages) * D * item + 1 KB.
    assert mod.shared_memory_bytes(_cfg(64, 32, 4, 3), 80, torch.float16, sm80) == (64 + 2 * 32 * 3) * 128 * 2 + 1024
    assert mod.shared_memory_bytes(_cfg(64, 32, 4, 3), 80, torch.float32) == (64 + 2 * 32 * 3) * 128 * 4 + 1024
    # AMD: 2 * BLOCK_N * D * item * max(1, stages - 1) + max(BLOCK_M * BLOCK_N, BLOCK_M * D) * item.
    assert mod.shared_memory_bytes(_cfg(64, 32, 4, 3), 80, torch.float16, gfx) == 2 * 32 * 128 * 2 * 2 + 64 * 128 * 2
    assert mod.shared_memory_bytes(_cfg(32, 128, 4, 1), 16, torch.float32, gfx) == 2 * 128 * 16 * 4 + 32 * 128 * 4
    assert mod.shared_memory_bytes(_cfg(32, 128, 4, 4), 16, torch.float32, gfx) == 2 * 128 * 16 * 4 * 3 + 32 * 128 * 4


def test_prune_reasons_name_the_limit():
    mod = _triton()
    fp16 = torch.float16
    assert mod.prune_reason(_cfg(16, 128, 4, 1), 64, fp16, None, None) == "BLOCK_N above the head dim and 64"
    assert mod.prune_reason(_cfg(16, 128, 4, 1), 80, fp16, None, None) is None  # 80 pads to 128
    assert mod.prune_reason(_cfg(16, 64, 4, 1), 16, fp16, None, None) is None
    assert mod.prune_reason(_cfg(16, 128, 4, 1), 128, fp16, None, None) is None
    # The bounds are exact, also for configs off the power-of-two axes.
    assert mod.prune_reason(_cfg(16, 65, 4, 1), 16, fp16, None, None) == "BLOCK_N above the head dim and 64"
    assert mod.prune_reason(_cfg(16, 64, 4, 1), 16, fp16, None, None) is None
    assert mod.prune_reason(_cfg(17, 16, 4, 1), 16, fp16, 1, None) == "BLOCK_M 17 is larger than the 1-row prompt"
    assert mod.prune_reason(_cfg(32, 16, 4, 1), 16, fp16, 17, None) is None
    assert mod.prune_reason(_cfg(64, 16, 4, 1), 16, fp16, 17, None) == "BLOCK_M 64 is larger than the 17-row prompt"
    assert mod.prune_reason(_cfg(16, 16, 4, 1), 16, fp16, 1, None) is None
    assert mod.prune_reason(_cfg(32, 16, 4, 1), 16, fp16, 1, None) == "BLOCK_M 32 is larger than the 1-row prompt"
    assert mod.prune_reason(_cfg(128, 16, 4, 1), 16, fp16, None, None) is None
    assert mod.prune_reason(_cfg(32, 64, 4, 1), 64, torch.float32, None, None) == \
        "32 fp32 score and accumulator values per lane (over 24) spill registers"
    assert mod.prune_reason(_cfg(128, 64, 4, 1), 64, fp16, None, _target("gfx942")) is None
    assert mod.prune_reason(_cfg(128, 64, 8, 3), 64, fp16, None, _target("gfx942")) == \
        "8 wave64 warps have 256 VGPRs per lane: K/V tiles this wide and deep spill"
    # Shared memory: (64 + 2*64*4) * 128 * 2 + 1024 = 148480 bytes (145 KB) fits sm_80's 163 KB, not the default 100.
    assert mod.prune_reason(_cfg(64, 64, 8, 4), 128, fp16, None, _target("sm_80")) is None
    assert mod.prune_reason(_cfg(64, 64, 8, 4), 128, fp16, None, None) == \
        "needs 145 KB of shared memory, the device allows 100 KB per block"
    # gfx942: 2*128*128*2*2 + 32*128*2 = 139264 bytes against 64 KB.
    assert mod.prune_reason(_cfg(32, 128, 4, 3), 128, fp16, None, _target("gfx942")) == \
        "needs 136 KB of shared memory, AMD Instinct MI300X allows 64 KB per block"
    # A program may use all of the block's shared memory.
    need = mod.shared_memory_bytes(_cfg(64, 64, 8, 4), 128, fp16, _target("sm_80"))
    exact = dataclasses.replace(_target("sm_80"), shared_memory_per_block=need)
    assert mod.prune_reason(_cfg(64, 64, 8, 4), 128, fp16, None, exact) is None
    short = dataclasses.replace(exact, shared_memory_per_block=need - 1)
    assert mod.prune_reason(_cfg(64, 64, 8, 4), 128, fp16, None, short) == \
        "needs 145 KB of shared memory, NVIDIA A100 allows 144 KB per block"


def test_candidate_configs_are_the_unpruned_product_of_the_axes():
    mod = _triton()
    for head_dim, dtype, q_len, target in [(64, torch.float16, None, None), (128, torch.float16, 17, _target("sm_80")),
                                           (16, torch.float32, 40, _target("gfx942"))]:
        expected = [mod.AttentionConfig(bm, bn, w, s) for bm in (16, 32, 64, 128) for bn in (16, 32, 64, 128)
                    for w in (4, 8) for s in (1, 2, 3, 4)
                    if mod.prune_reason(_cfg(bm, bn, w, s), head_dim, dtype, q_len, target) is None]
        assert mod.candidate_configs(head_dim, dtype, q_len, target) == expected
    assert mod.candidate_configs(64, torch.float16) == mod.candidate_configs(64, torch.float16, None, None)
    # q_len prunes by row count, the target by its limits.
    assert max(c.block_m for c in mod.candidate_configs(16, torch.float16, q_len=17)) == 32
    gfx = mod.candidate_configs(128, torch.float16, target=_target("gfx942"))
    assert gfx and gfx != mod.candidate_configs(128, torch.float16, target=_target("sm_90"))
    assert len(mod.candidate_configs(16, torch.float16)) == 96  # of 128: BLOCK_N 128 above a 16-wide head is pruned


def test_default_configs_per_device_dtype_and_head_dim(monkeypatch):
    mod = _triton()
    C = mod.AttentionConfig
    sm80, gfx = _target("sm_80"), _target("gfx942")
    assert mod.default_config(128, torch.float16, "cpu", gfx) == C(32, 32, 4, 1)
    assert mod.default_config(64, torch.float32, "cuda", sm80) == C(32, 64, 8, 2)
    assert mod.default_config(128, torch.float32, "cuda", sm80) == C(32, 16, 8, 2)
    assert mod.default_config(96, torch.float32, "cuda", gfx) == C(32, 16, 8, 2)  # 96 pads to 128
    assert mod.default_config(64, torch.float16, "cuda", gfx) == C(128, 64, 4, 2)
    assert mod.default_config(128, torch.bfloat16, "cuda", gfx) == C(128, 32, 8, 2)
    assert mod.default_config(64, torch.float16, "cuda", sm80) == C(128, 64, 8, 3)
    assert mod.default_config(128, torch.bfloat16, "cuda", sm80) == C(128, 32, 8, 3)
    # Without a target, the GPU torch sees decides.
    monkeypatch.setattr(mod, "current_target", lambda: gfx)
    assert mod.default_config(64, torch.float16, "cuda") == C(128, 64, 4, 2)
    assert mod.default_config(64, torch.float16, "cuda", sm80) == C(128, 64, 8, 3)
    monkeypatch.setattr(mod, "current_target", lambda: None)
    assert mod.default_config(64, torch.float16, "cuda") == C(128, 64, 8, 3)


def test_launch_args_hand_every_value_to_its_kernel_parameter():
    mod = _triton()
    q = torch.zeros(2, 4, 40, 24, dtype=torch.float16)
    k = torch.zeros(2, 2, 7, 24, dtype=torch.float16)
    v = torch.zeros(2, 7, 2, 24, dtype=torch.float16).transpose(1, 2)
    kv_len = torch.tensor([7, 3])
    launch = mod.launch_args(q, k, v, kv_len, causal=True, scale=0.5, q_offset=3, window=2,
                             config=mod.AttentionConfig(16, 32, 8, 3))
    assert launch.kernel is mod._attention_fwd
    assert launch.grid == (3, 8)  # ceil(40 / 16) row blocks, batch x query heads
    bound = launch.bound_args()
    out = bound.pop("Out")
    assert out.shape == (2, 4, 40, 24) and out.dtype == torch.float16 and out.device == q.device
    assert mod._output(launch) is out
    assert bound["Q"] is q and bound["K"] is k and bound["V"] is v and bound["KVLen"] is kv_len
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        assert tuple(bound[f"stride_{name}{axis}"] for axis in ("b", "h", "mn"[name in "kv"], "d")) == t.stride()
    assert {n: bound[n] for n in ("num_heads", "group", "q_len", "kv_len_max", "q_offset", "window")} == \
        dict(num_heads=4, group=2, q_len=40, kv_len_max=7, q_offset=3, window=2)
    assert type(bound["group"]) is int  # the kernel divides head indices by it: a float would compile as fp32
    assert bound["qk_scale"] == 0.5 * 1.4426950408889634
    assert launch.constexprs == dict(HEAD_DIM=24, BLOCK_D=32, BLOCK_M=16, BLOCK_N=32, CAUSAL=True, HAS_WINDOW=True,
                                     HAS_KV_LEN=True, UPCAST=True, IEEE=False)
    assert launch.options == dict(num_warps=8, num_stages=3)


def test_launch_args_flags_follow_the_inputs():
    mod = _triton()
    q = torch.zeros(1, 2, 5, 16)
    launch = mod.launch_args(q, q, q, causal=False, scale=1.0, window=4)
    # cpu: the interpreter's default config, the query stands in for the absent kv_len.
    assert launch.grid == (1, 2) and launch.options == dict(num_warps=4, num_stages=1)
    assert launch.args[4] is q and launch.args[3] is not q
    assert launch.constexprs == dict(HEAD_DIM=16, BLOCK_D=16, BLOCK_M=32, BLOCK_N=32, CAUSAL=False, HAS_WINDOW=False,
                                     HAS_KV_LEN=False, UPCAST=True, IEEE=True)
    assert mod.launch_args(q, q, q, causal=True, scale=1.0, window=0).constexprs["HAS_WINDOW"] is False
    assert mod.launch_args(q, q, q, causal=True, scale=1.0, window=1).constexprs["HAS_WINDOW"] is True
    assert mod.launch_args(q, q, q, causal=True, scale=1.0).bound_args()["q_offset"] == 0
    assert mod.launch_args(q, q, q, causal=True, scale=1.0).bound_args()["window"] == 0
    # Off the interpreter 16-bit tiles stay 16-bit; the GPU default config applies.
    meta = torch.empty(1, 2, 5, 64, dtype=torch.bfloat16, device="meta")
    gpu = mod.launch_args(meta, meta, meta, causal=True, scale=1.0)
    assert gpu.constexprs["UPCAST"] is False and gpu.constexprs["IEEE"] is False
    assert gpu.options == dict(num_warps=8, num_stages=3) and gpu.grid == (1, 2)
    assert mod._output(gpu).device == meta.device  # the output lives where the inputs do
    meta32 = meta.float()
    gpu32 = mod.launch_args(meta32, meta32, meta32, causal=True, scale=1.0)
    assert gpu32.constexprs["UPCAST"] is True and gpu32.options == dict(num_warps=8, num_stages=2)


def test_persistent_launch_args_hand_every_value_to_its_kernel_parameter():
    mod = _triton()
    q = torch.zeros(3, 4, 40, 24, dtype=torch.bfloat16)
    k = torch.zeros(3, 1, 9, 24, dtype=torch.bfloat16)
    v = torch.zeros(3, 9, 1, 24, dtype=torch.bfloat16).transpose(1, 2)
    kv_len = torch.tensor([9, 3, 1])
    launch = mod.persistent_launch_args(q, k, v, kv_len, causal=True, scale=0.25, q_offset=5, window=3, block_m=16,
                                        block_n=32, programs=7)
    assert launch.kernel is mod._attention_fwd_persistent
    assert launch.grid == (7,) and launch.options == {}
    bound = launch.bound_args()
    out = bound.pop("Out")
    assert out.shape == (3, 4, 40, 24) and out.dtype == torch.bfloat16
    assert bound["Q"] is q and bound["K"] is k and bound["V"] is v and bound["KVLen"] is kv_len
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        assert tuple(bound[f"stride_{name}{axis}"] for axis in ("b", "h", "mn"[name in "kv"], "d")) == t.stride()
    assert {n: bound[n] for n in ("num_heads", "batch_heads", "group", "q_len", "kv_len_max", "q_offset", "window")} \
        == dict(num_heads=4, batch_heads=12, group=4, q_len=40, kv_len_max=9, q_offset=5, window=3)
    assert type(bound["group"]) is int
    assert bound["qk_scale"] == 0.25 * 1.4426950408889634
    assert launch.constexprs == dict(HEAD_DIM=24, BLOCK_D=32, BLOCK_M=16, BLOCK_N=32, CAUSAL=True, HAS_WINDOW=True,
                                     HAS_KV_LEN=True, UPCAST=True, IEEE=False)
    for multibuffer in (True, False):
        assert mod.persistent_launch_args(q, k, v, causal=False, scale=1.0, block_m=16, block_n=16, programs=1,
                                          multibuffer=multibuffer).options == {"multibuffer": multibuffer}
    plain = mod.persistent_launch_args(q, k, v, causal=True, scale=1.0, block_m=16, block_n=16, programs=1)
    meta = q.to("meta")
    assert mod._output(mod.persistent_launch_args(meta, meta, meta, causal=True, scale=1.0, block_m=16, block_n=16,
                                                  programs=1)).device == meta.device
    assert plain.bound_args()["q_offset"] == 0 and plain.bound_args()["window"] == 0
    assert plain.args[4] is q and not plain.constexprs["HAS_KV_LEN"] and not plain.constexprs["HAS_WINDOW"]
    with pytest.raises(ValueError) as error:
        mod.persistent_launch_args(q, k, v, causal=True, scale=1.0, block_m=16, block_n=16, programs=0)
    assert str(error.value) == "the persistent attention kernel needs at least one program, got 0"


class _RecordingKernel:
    """Stands in for a JIT kernel: records the launch instead of running it."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def _spy(monkeypatch, mod, name):
    kernel, seen = _RecordingKernel(), []
    real = getattr(mod, name)

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return dataclasses.replace(real(*args, **kwargs), kernel=kernel)

    monkeypatch.setattr(mod, name, spy)
    return kernel, seen


def test_launch_runs_the_launch_its_arguments_describe(monkeypatch):
    mod = _triton()
    kernel, seen = _spy(monkeypatch, mod, "launch_args")
    q, k, v = torch.zeros(1, 2, 5, 16), torch.ones(1, 1, 6, 16), torch.full((1, 1, 6, 16), 2.0)
    kv_len, config = torch.tensor([4]), mod.AttentionConfig(16, 16, 4, 1)
    out = mod.launch(q, k, v, kv_len, causal=True, scale=0.5, q_offset=1, window=3, config=config)
    assert seen == [((q, k, v, kv_len), dict(causal=True, scale=0.5, q_offset=1, window=3, config=config))]
    ((grid, args, kwargs),) = kernel.calls
    assert grid == (1, 2) and args[:5] == (q, k, v, out, kv_len) and out.shape == (1, 2, 5, 16)
    assert kwargs["num_warps"] == 4 and kwargs["CAUSAL"] is True and kwargs["HAS_WINDOW"] is True
    seen.clear()
    mod.launch(q, k, v, causal=False, scale=0.5)
    assert seen == [((q, k, v, None), dict(causal=False, scale=0.5, q_offset=0, window=0, config=None))]
    # Nothing to compute: no launch.
    empty = mod.launch(q[:, :, :0], k, v, causal=True, scale=0.5)
    assert empty.shape == (1, 2, 0, 16) and len(kernel.calls) == 2


def test_launch_persistent_runs_the_launch_its_arguments_describe(monkeypatch):
    mod = _triton()
    kernel, seen = _spy(monkeypatch, mod, "persistent_launch_args")
    q, k, v = torch.zeros(1, 2, 5, 16), torch.ones(1, 1, 6, 16), torch.full((1, 1, 6, 16), 2.0)
    kv_len = torch.tensor([4])
    out = mod.launch_persistent(q, k, v, kv_len, causal=True, scale=0.5, q_offset=1, window=3, block_m=16,
                                block_n=32, programs=3, multibuffer=False)
    assert seen == [((q, k, v, kv_len), dict(causal=True, scale=0.5, q_offset=1, window=3, block_m=16, block_n=32,
                                             programs=3, multibuffer=False))]
    ((grid, args, kwargs),) = kernel.calls
    assert grid == (3,) and args[:5] == (q, k, v, out, kv_len) and out.shape == (1, 2, 5, 16)
    assert kwargs["multibuffer"] is False and kwargs["BLOCK_N"] == 32
    seen.clear()
    mod.launch_persistent(q, k, v, causal=False, scale=0.5, block_m=16, block_n=16, programs=1)
    assert seen == [((q, k, v, None), dict(causal=False, scale=0.5, q_offset=0, window=0, block_m=16, block_n=16,
                                           programs=1, multibuffer=None))]
    empty = mod.launch_persistent(q[:, :, :0], k, v, causal=True, scale=0.5, block_m=16, block_n=16, programs=1)
    assert empty.shape == (1, 2, 0, 16) and len(kernel.calls) == 2


def test_capability_refusals_are_worded_exactly(monkeypatch):
    from types import SimpleNamespace

    mod = _triton()
    assert _reason(LoweringContext(device_type="cpu", forced_provider=None)) == \
        "cpu tensors run Triton only under TRITON_INTERPRET=1 with provider='triton'"
    assert _reason(LoweringContext(device_type="npu", forced_provider=None)) == \
        "on npu the persistent Triton kernel (triton-ascend, untested on hardware) runs only with provider='triton'"
    assert _reason(LoweringContext(device_type="xpu", forced_provider="triton")) == "no Triton attention kernel for xpu"
    assert _reason(CUDA, q_shape=(2, 8, 16)) == "q, k, v are not 4-D"
    assert _reason(CUDA, k_shape=(2, 8, 16)) == "q, k, v are not 4-D"
    assert _reason(CUDA, v_shape=(1, 2, 8, 16, 1)) == "q, k, v are not 4-D"
    assert _reason(CUDA, k_dtype=torch.bfloat16) == \
        "dtypes torch.float16, torch.bfloat16, torch.float16 are not one of fp32/fp16/bf16"
    assert _reason(CUDA, dtype=torch.float64) == \
        "dtypes torch.float64, torch.float64, torch.float64 are not one of fp32/fp16/bf16"
    assert _reason(CUDA, k_shape=(1, 2, 8, 32), v_shape=(1, 2, 8, 16)) == "q, k and v head dims differ"
    assert _reason(CUDA, v_shape=(1, 2, 8, 32)) == "q, k and v head dims differ"
    assert _reason(CUDA, q_shape=(1, 2, 8, 257), k_shape=(1, 2, 8, 257)) == "head dim 257 is outside 1..256"
    assert _reason(CUDA, q_shape=(1, 2, 8, 0), k_shape=(1, 2, 8, 0)) == "head dim 0 is outside 1..256"
    assert _reason(CUDA, q_shape=(1, 2, 8, 256), k_shape=(1, 2, 8, 256)) is None
    assert _reason(CUDA, q_shape=(1, 2, 8, 1), k_shape=(1, 2, 8, 1)) is None
    kv = lambda t: _reason(CUDA, kv_len=t)  # noqa: E731
    assert kv(torch.tensor([1.0])) == "kv_len is not a 1-D integer tensor"
    assert kv(torch.tensor([[1]])) == "kv_len is not a 1-D integer tensor"
    assert kv(torch.tensor([1])) is None
    assert _reason(CUDA, q_offset=-1) == "negative q_offset or window"
    assert _reason(CUDA, window=-1) == "negative q_offset or window"
    assert _reason(CUDA, q_offset=0, window=0) is None
    q = torch.empty(1, 2, 8, 16, device="meta")
    assert mod._unsupported_reason(CUDA, q, q, q, causal=True, scale=float("inf")) == "scale is not finite"
    assert mod._unsupported_reason(CUDA, q, q, q, causal=True, scale=float("nan")) == "scale is not finite"
    # A symbolic head dim (dynamic shapes) is not an int.
    sym = SimpleNamespace(dim=lambda: 4, dtype=torch.float16, shape=(1, 2, 8, object()))
    static = SimpleNamespace(dim=lambda: 4, dtype=torch.float16, shape=(1, 2, 8, 16))
    assert mod._unsupported_reason(CUDA, sym, static, static, causal=True, scale=1.0) == "head dim is not static"
    assert mod._unsupported_reason(CUDA, static, static, sym, causal=True, scale=1.0) == "head dim is not static"
    monkeypatch.setattr(mod, "HAS_TRITON", False)
    assert _reason(CUDA) == "triton is not installed"


def test_forced_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert _reason(FORCED_CPU) == "cpu tensors run Triton only under TRITON_INTERPRET=1 with provider='triton'"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _reason(FORCED_CPU) is None
    assert _reason(LoweringContext(device_type="cuda", forced_provider="triton")) is None


def test_npu_default_asks_the_npu_space_with_the_problem(monkeypatch):
    from ttftc.autotune.space import Problem

    mod = _triton()
    asked, problems = [], []

    class Space:
        def default(self, problem):
            problems.append(problem)
            return {"block_m": 64}

    monkeypatch.setattr(mod, "space_for", lambda *args: asked.append(args) or Space())
    q = torch.empty(1, 8, 16, 64, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16, device="meta")
    kv_len = torch.empty(1, dtype=torch.int32, device="meta")
    options = dict(causal=True, scale=0.125, q_offset=0, window=0)
    assert mod._npu_default(q, kv, kv, kv_len, **options) == {"block_m": 64}
    assert asked == [("attention", "triton", "npu")]
    assert problems == [Problem.from_meta("attention", "triton", (q, kv, kv, kv_len), options)]
    monkeypatch.setattr(mod, "space_for", lambda *args: None)
    with pytest.raises(RuntimeError) as error:
        mod._npu_default(q, kv, kv, kv_len, **options)
    assert str(error.value) == ("the triton-ascend attention space is not registered: import "
                                "ttftc.codegen.triton.attention_ascend (ttftc.codegen.providers imports it)")


class _OnNpu:
    """A query tensor as attention_triton reads it on an Ascend device: only its device type (no NPU here)."""

    device = type("Device", (), {"type": "npu"})()


def test_the_lowering_launches_the_persistent_kernel_on_npu_and_the_tiled_one_elsewhere(monkeypatch):
    mod = _triton()
    calls = []
    monkeypatch.setattr(mod, "launch", lambda *args, **kwargs: calls.append(("launch", args, kwargs)) or "tiled")
    monkeypatch.setattr(mod, "launch_persistent",
                        lambda *args, **kwargs: calls.append(("persistent", args, kwargs)) or "persistent")
    monkeypatch.setattr(mod, "current_device", lambda: "npu:0")
    monkeypatch.setattr(mod, "launch_grid", lambda device: calls.append(("grid", device)) or (24,))
    monkeypatch.setattr(mod, "_npu_default", lambda *args, **kwargs: calls.append(("default", args, kwargs))
                        or {"block_m": 64, "block_n": 128, "multibuffer": True})
    q, k, v, kv_len = _OnNpu(), "k", "v", "kv_len"
    assert mod.attention_triton(q, k, v, kv_len, causal=True, scale=0.3) == "persistent"
    defaults = dict(causal=True, scale=0.3, q_offset=0, window=0)
    assert calls == [("default", (q, k, v, kv_len), defaults), ("grid", "npu:0"),
                     ("persistent", (q, k, v, kv_len), dict(defaults, block_m=64, block_n=128, programs=24,
                                                              multibuffer=True))]
    calls.clear()  # a tuned config is used as it is
    tuned = {"block_m": 32, "block_n": 64, "multibuffer": False}
    mod.attention_triton(q, k, v, None, causal=False, scale=0.5, q_offset=3, window=8, tuning_config=tuned)
    assert [c[0] for c in calls] == ["grid", "persistent"]
    assert calls[1][2] == dict(causal=False, scale=0.5, q_offset=3, window=8, block_m=32, block_n=64, programs=24,
                               multibuffer=False)
    calls.clear()
    q_cpu = torch.empty(1, 2, 4, 16)
    assert mod.attention_triton(q_cpu, k, v, causal=True, scale=0.3) == "tiled"
    assert calls == [("launch", (q_cpu, k, v, None), dict(defaults, config=None))]
    calls.clear()
    mod.attention_triton(q_cpu, k, v, kv_len, causal=True, scale=0.3, tuning_config={"block_m": 32, "block_n": 16,
                                                                                      "num_warps": 4, "num_stages": 2})
    assert calls[0][1] == (q_cpu, k, v, kv_len)
    assert calls[0][2]["config"] == mod.AttentionConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)
