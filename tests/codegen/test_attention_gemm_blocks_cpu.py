"""The CPU attention lowering's second plain-causal kernel, `gemm_blocks` (batched GEMMs per block of query rows),
and how the lowering picks between it and ATen's flash kernel."""

import pytest
import torch

from ttftc.autotune.space import Problem, TensorSpec, space_for
from ttftc.codegen.cpu import attention as cpu_attention
from ttftc.codegen.cpu import _native
from ttftc.codegen.cpu.attention import attention_cpu

# bf16/fp16: the kernel rounds scores to the input dtype before the (fp32-accumulated) softmax, as Hugging Face's
# eager attention does, so its error is about twice the flash kernel's (which keeps scores in fp32).
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 6e-2, torch.float16: 1e-2}


def _reference(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    n = q.shape[2]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def _qkv(b, h, hkv, s, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Stored as [B, S, H, D] and viewed as [B, H, S, D], as the projections of every model produce them.
    q = (torch.randn(b, s, h, d, generator=gen) * 2).to(dtype).transpose(1, 2)
    k, v = (torch.randn(b, s, hkv, d, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    return q, k, v


def test_each_block_of_query_rows_is_two_gemms_over_the_keys_up_to_its_last_row(monkeypatch):
    q, k, v = _qkv(1, 2, 1, 10, 32, torch.float32)  # two query heads per kv head, 10 rows in blocks of 4
    products = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm",
                        lambda a, b: products.append(tuple(a.shape[1:]) + (b.shape[2],)) or real_bmm(a, b))
    out = attention_cpu(q, k, v, causal=True, scale=0.3, tuning_config={"kernel": "gemm_blocks", "gemm_block_rows": 4})
    # per block: (heads x rows, d) @ keys[:stop]^T, then (heads x rows, stop) @ values[:stop]
    assert products == [(8, 32, 4), (8, 4, 32), (8, 32, 8), (8, 8, 32), (4, 32, 10), (4, 10, 32)]
    torch.testing.assert_close(out.double(), _reference(q, k, v, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,hkv,s,rows", [(1, 9, 3, 300, 64), (2, 4, 4, 129, 128), (1, 6, 2, 17, 256),
                                            (1, 2, 1, 1, 64)])
def test_gemm_blocks_match_the_reference(dtype, b, h, hkv, s, rows):
    q, k, v = _qkv(b, h, hkv, s, 32, dtype)
    out = attention_cpu(q, k, v, causal=True, scale=0.3,
                        tuning_config={"kernel": "gemm_blocks", "gemm_block_rows": rows})
    assert out.dtype == dtype and out.shape == (b, h, s, 32)
    assert out.transpose(1, 2).is_contiguous()  # the flash layout the lowering declares
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), _reference(q, k, v, 0.3), atol=tol, rtol=tol)


def test_the_two_kernels_agree_in_fp32():
    q, k, v = _qkv(1, 8, 2, 200, 64, torch.float32, seed=3)
    flash = attention_cpu(q, k, v, causal=True, scale=0.3, tuning_config={"kernel": "flash"})
    blocks = attention_cpu(q, k, v, causal=True, scale=0.3, tuning_config={"kernel": "gemm_blocks"})
    torch.testing.assert_close(blocks, flash, atol=1e-5, rtol=1e-5)


def test_without_a_tuned_kernel_the_measured_faster_one_runs(monkeypatch):
    ran = []
    real = cpu_attention._causal_gemm_blocks
    monkeypatch.setattr(cpu_attention, "_causal_gemm_blocks", lambda *a: ran.append("gemm_blocks") or real(*a))
    monkeypatch.setattr(cpu_attention, "kernel_seconds", lambda dtype: {"flash": 2.0, "gemm_blocks": 1.0})
    q, k, v = _qkv(1, 4, 4, 40, 16, torch.bfloat16)
    attention_cpu(q, k, v, causal=True, scale=0.25)
    assert ran == ["gemm_blocks"]
    monkeypatch.setattr(cpu_attention, "kernel_seconds", lambda dtype: {"flash": 1.0, "gemm_blocks": 2.0})
    attention_cpu(q, k, v, causal=True, scale=0.25)
    assert ran == ["gemm_blocks"]  # flash this time


def test_the_untuned_kernel_is_the_one_measured_for_the_querys_dtype(monkeypatch):
    asked = []
    monkeypatch.setattr(cpu_attention, "fastest_kernel", lambda dtype: asked.append(dtype) or "flash")
    attention_cpu(*_qkv(1, 4, 2, 12, 16, torch.bfloat16), causal=True, scale=0.25)
    assert asked and set(asked) == {torch.bfloat16}


def test_gemm_blocks_take_grouped_heads_whatever_the_query_count(monkeypatch):
    ran = []
    real = cpu_attention._causal_gemm_blocks
    monkeypatch.setattr(cpu_attention, "_causal_gemm_blocks", lambda *a: ran.append("gemm_blocks") or real(*a))
    q, k, v = _qkv(1, 4, 2, 9, 16, torch.float32)  # 9 queries: not a multiple of the 2 kv heads
    out = attention_cpu(q, k, v, causal=True, scale=0.3, tuning_config={"kernel": "gemm_blocks"})
    assert ran == ["gemm_blocks"]
    torch.testing.assert_close(out.double(), _reference(q, k, v, 0.3), atol=1e-5, rtol=1e-5)


def test_the_default_kernel_is_the_fastest_measured_for_each_dtype(monkeypatch):
    monkeypatch.setattr(cpu_attention, "kernel_seconds",
                        lambda dtype: {"flash": 2.0, "gemm_blocks": 3.0, "native": 1.0} if dtype == torch.float32
                        else {"flash": 2.0, "gemm_blocks": 1.0})
    assert cpu_attention.fastest_kernel(torch.float32) == "native"
    assert cpu_attention.fastest_kernel(torch.bfloat16) == "gemm_blocks"


def test_a_kernel_is_timed_on_a_causal_prefill_problem_as_the_best_of_its_repeats(monkeypatch):
    calls, clock = [], iter([0.0, 5.0, 10.0, 12.0, 20.0, 24.0])  # the three timed runs take 5, 2 and 4 s

    def attend(q, k, v, kv_len, **kwargs):
        calls.append(((q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, kv_len), kwargs))

    monkeypatch.setattr(cpu_attention, "_attend", attend)
    monkeypatch.setattr(cpu_attention.time, "perf_counter", lambda: next(clock))
    assert cpu_attention._kernel_seconds("gemm_blocks", torch.bfloat16) == 2.0
    assert len(calls) == 4  # a warm-up run, then the three timed ones
    shape = torch.Size([1, 8, 512, 64])  # 8 heads x 512 tokens x 64, in the lowering's [B, H, S, D] layout
    expected_tuning = {**cpu_attention.DEFAULT_TUNING, "kernel": "gemm_blocks"}
    for args, kwargs in calls:
        assert args == (shape, shape, shape, torch.bfloat16, torch.bfloat16, torch.bfloat16, None)
        assert kwargs == dict(causal=True, scale=0.125, q_offset=0, window=0, tuning=expected_tuning)
    clock = iter([1.0, 4.0])
    monkeypatch.setattr(cpu_attention.time, "perf_counter", lambda: next(clock))
    assert cpu_attention._kernel_seconds("flash", torch.float32, repeats=1) == 3.0


def test_offset_window_and_kv_len_cases_never_take_gemm_blocks(monkeypatch):
    monkeypatch.setattr(cpu_attention, "_causal_gemm_blocks", lambda *a: pytest.fail("gemm_blocks on a masked case"))
    tuning = {"kernel": "gemm_blocks"}
    q, k, v = _qkv(2, 4, 2, 30, 16, torch.float32)
    attention_cpu(q, k, v, causal=True, scale=0.25, q_offset=5, tuning_config=tuning)
    attention_cpu(q, k, v, causal=True, scale=0.25, window=7, tuning_config=tuning)
    attention_cpu(q, k, v, torch.tensor([20, 11]), causal=True, scale=0.25, tuning_config=tuning)
    attention_cpu(q, k, v, causal=False, scale=0.25, tuning_config=tuning)


def _problem(q_offset=0, window=0, dtype=torch.bfloat16):
    q, k, v = _qkv(1, 4, 2, 64, 16, dtype)
    return Problem.from_meta("attention", "cpu", (q, k, v), {"causal": True, "scale": 0.25, "q_offset": q_offset,
                                                               "window": window})


def test_autotune_tries_each_kernel_only_where_it_applies(monkeypatch):
    monkeypatch.setattr(cpu_attention, "kernel_seconds", lambda dtype: {"flash": 2.0, "gemm_blocks": 1.0})
    space = space_for("attention", "cpu", "cpu")
    plain, _ = space.candidates(_problem())
    assert plain[0]["kernel"] == "gemm_blocks"  # the default: the measured faster kernel
    kernels = {(c["kernel"], c["gemm_block_rows"]) for c in plain}
    assert ("flash", cpu_attention.DEFAULT_TUNING["gemm_block_rows"]) in kernels
    assert {rows for kernel, rows in kernels if kernel == "gemm_blocks"} == {64, 128, 256}
    assert {rows for kernel, rows in kernels if kernel == "flash"} == {cpu_attention.DEFAULT_TUNING["gemm_block_rows"]}
    assert all(c["small_mask_pairs"] == cpu_attention.DEFAULT_TUNING["small_mask_pairs"] for c in plain)
    # the native kernel runs bf16 only where the CPU has AVX512-BF16 dot products
    native = {"native"} if torch.bfloat16 in _native.attention_dtypes() else set()
    assert {c["kernel"] for c in plain} == {"flash", "gemm_blocks"} | native
    offset, _ = space.candidates(_problem(q_offset=8))
    # gemm_blocks only runs plain causal attention: with an offset the default is flash, and flash's mask knobs vary
    assert offset[0]["kernel"] == "flash"
    assert {c["kernel"] for c in offset} == {"flash"} | native and len({c["small_mask_pairs"] for c in offset}) > 1


def test_each_pruned_attention_candidate_says_why():
    rule, defaults = cpu_attention._knobs_of_its_kernel, dict(cpu_attention.DEFAULT_TUNING)
    plain, offset, window = (_problem(q_offset=o, window=w, dtype=torch.float32) for o, w in ((0, 0), (8, 0), (0, 4)))
    spec = TensorSpec((1, 2, 8, 16), torch.float32)
    no_options = Problem("attention", "cpu", (spec, spec, spec), ())  # offset and window default to 0: plain
    gemm, flash = {**defaults, "kernel": "gemm_blocks"}, {**defaults, "kernel": "flash", "window_block_rows": 64}
    assert rule(gemm, plain) is None and rule(gemm, no_options) is None
    for masked in (offset, window):
        assert rule(gemm, masked) == "gemm_blocks only runs plain causal attention (the rest is flash's)"
        assert rule(flash, masked) is None  # flash's mask knobs matter there
    assert rule(flash, plain) == (
        "the flash kernel ignores window_block_rows, small_mask_pairs, gemm_block_rows, native_block_k here")
    # the query's dtype decides (the key's differs here only to show which one is read)
    fp16_q = Problem("attention", "cpu", (TensorSpec((1, 2, 8, 16), torch.float16), spec, spec), ())
    assert rule({**defaults, "kernel": "native"}, fp16_q) == "the native kernel does not run torch.float16 here"


def test_the_default_kernel_is_the_fastest_for_the_querys_dtype_where_it_applies(monkeypatch):
    fastest = {torch.float32: "native", torch.bfloat16: "gemm_blocks"}
    monkeypatch.setattr(cpu_attention, "fastest_kernel", lambda dtype: fastest[dtype])
    assert cpu_attention._default_config(_problem(dtype=torch.bfloat16))["kernel"] == "gemm_blocks"
    assert cpu_attention._default_config(_problem(q_offset=8, dtype=torch.bfloat16))["kernel"] == "flash"
    assert cpu_attention._default_config(_problem(window=4, dtype=torch.bfloat16))["kernel"] == "flash"
    assert cpu_attention._default_config(_problem(q_offset=8, dtype=torch.float32))["kernel"] == "native"


def test_kernel_seconds_times_each_kernel_that_can_run_the_dtype_in_that_dtype(monkeypatch):
    # a time that says which kernel and dtype it timed: len(kernel) + 0.5 for bf16
    monkeypatch.setattr(cpu_attention, "_kernel_seconds",
                        lambda kernel, dtype: len(kernel) + {torch.bfloat16: 0.5}.get(dtype, 0.25))
    monkeypatch.setattr(cpu_attention, "kernels_for", lambda dtype: {torch.bfloat16: ("flash", "native")}.get(dtype, ()))
    measure = cpu_attention.kernel_measurement.__wrapped__  # the uncached body (this test's own empty store)
    assert measure(torch.bfloat16)[0] == {"flash": 5.5, "native": 6.5}
