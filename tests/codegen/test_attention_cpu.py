"""The CPU lowering vs the reference, on each of its kernels: ATen's flash kernel (with the op's offset/window/kv_len
rewritten onto it) and ttftc's native fp32 kernel (every mask in one pass; other dtypes fall back to flash)."""

from __future__ import annotations

import pytest
import torch

import ttftc
from ttftc import zoo
from ttftc.codegen.cpu import _native
from ttftc.codegen.cpu import attention as cpu_attention
from ttftc.codegen.cpu.attention import _unsupported_reason, attention_cpu
from ttftc.codegen.registry import LoweringContext
from ttftc.ops.attention import attention
from tests.helpers import TOLERANCES, assert_logits_match, compile_and_run, needs_transformers

FP32_TOL = (1e-5, 1e-5)
# Not head_dim**-0.5 (the flash kernel's own default for every head dim here): a path that drops `scale` fails.
SCALE = 0.3


@pytest.fixture(autouse=True, params=["flash", "native"])
def kernel(request, monkeypatch):
    """Every case runs on the flash kernel and on the native one, whatever this CPU measured faster. The GEMM-blocked
    kernel, with its own (bf16-score) tolerances, is tested in test_attention_gemm_blocks_cpu.py. The native
    kernel's absence is a failure of its own (tests/codegen/test_native_cpu.py), not a reason to skip here."""
    if request.param == "native" and _native.unavailable_reason() is not None:
        pytest.skip(_native.unavailable_reason())
    monkeypatch.setitem(cpu_attention.DEFAULT_TUNING, "kernel", request.param)
    return request.param


# For the tests of the flash kernel's own rewrites (thresholds, merges, window blocks): flash only.
flash_only = pytest.mark.parametrize("kernel", ["flash"], indirect=True)


@pytest.fixture(params=["one-masked-call", "memory-bounded"])
def path(request, monkeypatch):
    """Offset and window cases take an explicit mask when small, else the rewrites; test cases are small, so the
    memory-bounded rewrites are forced by lowering the size threshold to 0."""
    if request.param == "memory-bounded":
        monkeypatch.setitem(cpu_attention.DEFAULT_TUNING, "small_mask_pairs", 0)
    return request.param


def _qkv(b, hq, hkv, sq, skv, d, dtype=torch.float32):
    gen = torch.Generator().manual_seed(sq * 7 + skv)
    # Scores of a few units: softmax is far from uniform, so a wrong scale or a lost mask shows in the output.
    q = (torch.randn(b, hq, sq, d, generator=gen) * 2).to(dtype)
    k = torch.randn(b, hkv, skv, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, skv, d, generator=gen).to(dtype)
    return q, k, v


def _check(b, hq, hkv, sq, skv, d=16, *, causal, q_offset=0, window=0, dtype=torch.float32, kv_len=None,
           scale=SCALE):
    q, k, v = _qkv(b, hq, hkv, sq, skv, d, dtype)
    params = dict(causal=causal, scale=scale, q_offset=q_offset, window=window)
    out = attention_cpu(q, k, v, kv_len, **params)
    expected = attention.reference(q.float(), k.float(), v.float(), kv_len, **params)
    atol, rtol = FP32_TOL if dtype == torch.float32 else TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == (b, hq, sq, d)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("length", [1, 17, 127, 300])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_offset", [0, 9])
def test_plain_attention(length, causal, q_offset):
    _check(1, 4, 2, length, length, causal=causal, q_offset=q_offset)


@pytest.mark.parametrize("sq,skv,q_offset", [(17, 40, 23), (9, 30, 4), (1, 50, 49), (8, 8, 20), (5, 10, 10),
                                             (5, 10, 9)])
def test_causal_offset(path, sq, skv, q_offset):
    _check(1, 4, 1, sq, skv, causal=True, q_offset=q_offset)


@pytest.mark.parametrize("window,q_offset", [(1, 0), (7, 0), (300, 0), (5, 10), (600, 0), (7, 33), (40, 290),
                                             (299, 1), (300, 1)])
def test_sliding_window(path, window, q_offset):
    _check(1, 2, 2, 300 - q_offset, 300, causal=True, q_offset=q_offset, window=window)


def test_per_sequence_kv_len_including_empty(path):
    _check(3, 2, 1, 33, 40, causal=True, q_offset=7, kv_len=torch.tensor([40, 12, 0]))
    _check(2, 2, 2, 20, 20, causal=False, q_offset=5, kv_len=torch.tensor([3, 20]))
    _check(2, 4, 2, 12, 30, causal=True, q_offset=18, window=9, kv_len=torch.tensor([30, 25]))


def test_per_sequence_kv_len_all_full_or_all_short(path):
    _check(2, 2, 1, 12, 20, causal=True, q_offset=8, kv_len=torch.tensor([20, 20]))
    _check(2, 2, 1, 12, 20, causal=True, q_offset=8, kv_len=torch.tensor([15, 9]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(path, dtype):
    _check(1, 4, 4, 65, 65, 32, causal=True, dtype=dtype)
    _check(1, 4, 1, 20, 50, 32, causal=True, q_offset=30, dtype=dtype)
    _check(1, 4, 2, 40, 70, 32, causal=True, q_offset=30, window=12, dtype=dtype)


@pytest.mark.parametrize("causal,q_offset,window", [(False, 0, 0), (True, 0, 0), (True, 13, 0), (True, 0, 6),
                                                    (True, 13, 6)])
@pytest.mark.parametrize("scale", [0.1, 1.0])
def test_scale_reaches_every_path(path, causal, q_offset, window, scale):
    """Each path (one flash call, the additive-mask call, the logsumexp merge, the window blocks, per-sequence
    kv_len) computes softmax(scale * q k^T): scale 0.1 and 1.0 are both far from the kernel default 0.25."""
    _check(1, 2, 1, 24, 24 + q_offset, causal=causal, q_offset=q_offset, window=window, scale=scale)
    _check(2, 2, 1, 24, 24 + q_offset, causal=causal, q_offset=q_offset, window=window, scale=scale,
           kv_len=torch.tensor([24 + q_offset, 20]))


def test_rows_past_every_window_are_zeros(path):
    """Queries whose window lies wholly after the last key (positions 40.. with 20 keys, window 5) see nothing."""
    _check(1, 2, 1, 10, 20, causal=True, q_offset=40, window=5)
    _check(1, 2, 1, 30, 20, causal=True, q_offset=10, window=5)  # the first rows see keys, the last ones none
    _check(1, 2, 1, 10, 20, causal=True, q_offset=24, window=5)  # the first window starts right after the last key


def test_empty_queries_or_keys_give_an_empty_or_zero_result():
    q, k, v = _qkv(1, 2, 1, 6, 9, 16)
    empty_q = attention_cpu(q[:, :, :0], k, v, causal=True, scale=SCALE, q_offset=3)
    assert empty_q.shape == (1, 2, 0, 16)
    no_keys = attention_cpu(q, k[:, :, :0], v[:, :, :0], causal=False, scale=SCALE)
    assert no_keys.shape == (1, 2, 6, 16) and not no_keys.any()


@flash_only
def test_the_two_call_causal_merge_handles_every_offset_directly():
    q, k, v = _qkv(1, 2, 1, 6, 9, 16)
    for q_offset in (0, 3, 9, 12):
        expected = attention.reference(q, k, v, causal=True, scale=SCALE, q_offset=q_offset, window=0)
        got = cpu_attention._causal_from_offset(q, k, v, SCALE, q_offset)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def paths(monkeypatch):
    """Which path each call took: "plain" (one flash call, no mask), "mask", "window" or "merge"."""
    taken = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            taken.append(name)
            return fn(*args, **kwargs)
        monkeypatch.setattr(cpu_attention, fn.__name__, wrapped)

    spy("mask", cpu_attention._full_mask)
    spy("window", cpu_attention._sliding_window)
    spy("merge", cpu_attention._causal_from_offset)
    return taken


@flash_only
@pytest.mark.parametrize("sq,skv,q_offset,window,small,expected", [
    (8, 8, 0, 0, 0, []),  # plain causal prefill: one flash call whatever the threshold
    (8, 8, 0, 8, 0, []),  # a window as long as the prompt hides nothing
    (8, 8, 0, 7, 0, ["window"]),
    (8, 8, 0, 7, 64, ["mask"]),  # 8 x 8 pairs: at the threshold, the explicit mask
    (8, 8, 0, 7, 63, ["window"]),
    (8, 12, 4, 0, 96, ["mask"]),
    (8, 12, 4, 0, 95, ["merge"]),
    (8, 12, 4, 12, 0, ["merge"]),  # window = q_offset + Sq hides nothing: the offset alone decides
    (8, 12, 4, 11, 0, ["window"]),
])
def test_paths_follow_the_documented_thresholds(paths, sq, skv, q_offset, window, small, expected):
    q, k, v = _qkv(1, 2, 1, sq, skv, 16)
    params = dict(causal=True, scale=SCALE, q_offset=q_offset, window=window)
    out = attention_cpu(q, k, v, tuning_config={"small_mask_pairs": small}, **params)
    assert paths == expected
    torch.testing.assert_close(out, attention.reference(q, k, v, **params), atol=1e-5, rtol=1e-5)


def test_the_output_is_in_the_flash_kernels_layout():
    q, k, v = _qkv(2, 4, 2, 5, 7, 16)
    for kwargs in (dict(causal=True), dict(causal=True, q_offset=2), dict(causal=False)):
        out = attention_cpu(q, k, v, scale=SCALE, **kwargs)
        assert out.shape == (2, 4, 5, 16) and out.transpose(1, 2).is_contiguous()
    per_sequence = attention_cpu(q, k, v, torch.tensor([7, 3]), causal=True, scale=SCALE, q_offset=2)
    assert per_sequence.transpose(1, 2).is_contiguous()
    fake = cpu_attention._flash_layout_fake(q, k, v[..., :8], causal=True, scale=SCALE)
    assert fake.shape == (2, 4, 5, 8) and fake.transpose(1, 2).is_contiguous()
    strided = torch.randn(2, 4, 5, 16)  # [B, H, S, D] contiguous: copied into the flash layout
    assert cpu_attention._in_flash_layout(strided).transpose(1, 2).is_contiguous()
    torch.testing.assert_close(cpu_attention._in_flash_layout(strided), strided, atol=0, rtol=0)
    flash = strided.transpose(1, 2).contiguous().transpose(1, 2)
    assert cpu_attention._in_flash_layout(flash) is flash  # already in the layout: not copied


def test_capability():
    cpu = LoweringContext(device_type="cpu", forced_provider=None)
    q = torch.empty(1, 2, 8, 16, device="meta")
    ok = dict(causal=True, scale=0.25)
    assert _unsupported_reason(cpu, q, q, q, **ok) is None
    assert _unsupported_reason(cpu, q.half(), q.half(), q.half(), **ok) is None
    assert _unsupported_reason(cpu, q, q, q, torch.tensor([8]), q_offset=3, window=2, **ok) is None
    assert _unsupported_reason(cpu, q[0], q, q, **ok) == "q, k, v are not 4-D"
    assert "not 4-D" in _unsupported_reason(cpu, q, q, q[0], **ok)
    assert _unsupported_reason(cpu, q, q, q, torch.tensor([8.0]), **ok) == "kv_len is not a 1-D integer tensor"
    assert "1-D integer" in _unsupported_reason(cpu, q, q, q, torch.tensor([[8]]), **ok)
    assert _unsupported_reason(cpu, q, q, q, q_offset=-1, **ok) == "negative q_offset or window"
    assert "negative" in _unsupported_reason(cpu, q, q, q, window=-1, **ok)
    assert "dtypes differ" in _unsupported_reason(cpu, q, q, q.half(), **ok)
    assert _unsupported_reason(LoweringContext("cuda", None), q, q, q, **ok) is not None
    assert "dtypes differ" in _unsupported_reason(cpu, q, q.half(), q, **ok)
    assert _unsupported_reason(cpu, q, q, torch.empty(1, 2, 8, 32, device="meta"), **ok) == (
        "the flash kernel needs one head dim for q, k and v")
    assert "fp32/fp16/bf16" in _unsupported_reason(cpu, q.double(), q.double(), q.double(), **ok)


@needs_transformers
# gemma: query_pre_attn_scalar (256) sets its scale to 1/16 where head_dim**-0.5 is 1/4.
@pytest.mark.parametrize("family,attn", [("qwen2", "eager"), ("mistral", "sdpa"), ("gpt2", "eager"), ("gemma", "sdpa")])
def test_whole_zoo_model_uses_the_cpu_lowering(family, attn):
    model = zoo.build(family, attn)
    ids = zoo.example_ids(model, 10)
    actual, expected, report = compile_and_run(model, ids, ttftc.Config(passes=("attention",)))
    assert report.providers["attention"] == {"cpu": model.config.num_hidden_layers}
    assert_logits_match(actual, expected)


@pytest.mark.slow
def test_no_quadratic_memory_at_4096_tokens():
    """No op of the lowering allocates anything near one Sq x Skv score matrix, for any of its paths."""
    sq, heads, d = 4096, 4, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, sq, d, generator=gen) for _ in range(3))
    one_head_scores = sq * sq * 4  # a single fp32 [Sq, Skv] matrix: 64 MiB
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        attention_cpu(q, k, v, causal=True, scale=SCALE)  # plain causal
        attention_cpu(q[:, :, 1024:], k, v, causal=True, scale=SCALE, q_offset=1024)  # chunked prefill
        attention_cpu(q, k, v, causal=True, scale=SCALE, window=512)  # sliding window
    # Per call: the bytes one op allocated itself (a 64 MiB score matrix would show up here).
    biggest = max(prof.events(), key=lambda e: e.cpu_memory_usage)
    assert biggest.cpu_memory_usage < one_head_scores / 4, (biggest.name, biggest.cpu_memory_usage)


@flash_only
def test_window_blocks_read_only_the_keys_their_rows_can_see(monkeypatch):
    """One flash call per block of query rows, over keys [first row - window + 1, last row]: scores per block stay
    rows x (rows + window - 1)."""
    calls = []
    flash = cpu_attention._flash

    def counting(q, k, *args, **kwargs):
        calls.append((q.shape[2], k.shape[2]))
        return flash(q, k, *args, **kwargs)

    monkeypatch.setattr(cpu_attention, "_flash", counting)
    q, k, v = _qkv(1, 2, 1, 300, 300, 16)
    params = dict(causal=True, scale=SCALE, q_offset=0, window=40)
    out = attention_cpu(q, k, v, tuning_config={"window_block_rows": 128, "small_mask_pairs": 0}, **params)
    assert calls == [(128, 128), (128, 128 + 39), (44, 44 + 39)]
    torch.testing.assert_close(out, attention.reference(q, k, v, **params), atol=1e-5, rtol=1e-5)


@flash_only
@pytest.mark.parametrize("tuning", [{"window_block_rows": 64, "small_mask_pairs": 0},
                                    {"window_block_rows": 512, "small_mask_pairs": 1 << 22}])
def test_every_tuning_config_is_exact(tuning):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 150, 16, generator=gen) for _ in range(3))
    params = dict(causal=True, scale=SCALE, q_offset=25, window=40)
    out = attention_cpu(q, k, v, tuning_config=tuning, **params)
    torch.testing.assert_close(out, attention.reference(q, k, v, **params), atol=1e-5, rtol=1e-5)
