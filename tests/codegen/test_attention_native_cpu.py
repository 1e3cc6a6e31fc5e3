"""ttftc's native attention kernel (ttftc/codegen/cpu/csrc/attention_kernel.h, and attention_bf16_kernel.h for bf16)
against an fp64 reference, on every instruction-set version this CPU can run, and the module's guards (build
present, sources current, inputs validated)."""

from __future__ import annotations

import io
import platform
import re
import shutil

import pytest
import torch

from ttftc.codegen.cpu import _native
from ttftc.codegen.cpu import attention as cpu_attention
from ttftc.codegen.cpu.attention import attention_cpu
from ttftc.codegen.cpu.measured import cpu_flags_and_name

from tests.codegen.conftest import NATIVE_ISAS, native_isas_here

SCALE = 0.3  # not head_dim**-0.5: a kernel that ignores scale fails


def test_the_kernels_are_built_where_a_compiler_was():
    """A silent build failure at install would otherwise only show as a slower CPU path."""
    if platform.system() != "Linux" or shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no Linux C++ toolchain: the extension is optional")
    assert _native.unavailable_reason() is None
    assert _native.isa() in NATIVE_ISAS


def _reference(q, k, v, kv_len=None, *, causal, q_offset=0, window=0, scale=SCALE):
    b, hq, sq, _ = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    k64, v64 = (t.double().repeat_interleave(hq // hkv, 1) for t in (k, v))
    scores = q.double() @ k64.transpose(-1, -2) * scale
    pos = torch.arange(sq)[:, None] + q_offset
    cols = torch.arange(skv)[None, :]
    visible = torch.ones(sq, skv, dtype=torch.bool)
    if causal:
        visible &= cols <= pos
        if window:
            visible &= cols > pos - window
    visible = visible.expand(b, 1, sq, skv).clone()
    if kv_len is not None:
        for row, n in enumerate(kv_len.tolist()):
            visible[row, :, :, n:] = False
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    return probs @ v64


def _qkv(b, hq, hkv, sq, skv, d, dv=None, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # [B, S, H, D] storage viewed as [B, H, S, D], as projections produce them; scores of a few units
    q = (torch.randn(b, sq, hq, d, generator=gen) * 2).to(dtype).transpose(1, 2)
    k = torch.randn(b, skv, hkv, d, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(b, skv, hkv, dv or d, generator=gen).to(dtype).transpose(1, 2)
    return q, k, v


# fp32: the fp64 reference to 1e-5. bf16: FlashAttention-2's bf16 numerics (probabilities rounded to bf16 before
# the value product, the output rounded once), against the fp64 reference of the same bf16 inputs.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(params=[(isa, torch.float32) for isa in NATIVE_ISAS] + [("avx512_bf16", torch.bfloat16)],
                ids=lambda p: f"{p[0]}-{str(p[1]).replace('torch.', '')}")
def isa_and_dtype(request):
    """Each instruction-set version of the kernel this CPU runs, with each dtype that version has."""
    isa, dtype = request.param
    if isa not in native_isas_here():
        pytest.skip(f"this CPU does not run the {isa} kernels")
    previous = _native.set_isa(isa)
    yield isa, dtype
    _native.set_isa(previous)


def _run(q, k, v, kv_len=None, *, causal, q_offset=0, window=0, block_k=128, threads=2, pack_kv=False):
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1], dtype=q.dtype).transpose(1, 2)
    return _native.attention(q, k, v, out, kv_len, causal=causal, scale=SCALE, q_offset=q_offset,
                             window=window, block_k=block_k, threads=threads, pack_kv=pack_kv)


CASES = [  # b, hq, hkv, sq, skv, d, dv, causal, q_offset, window, kv_len
    (1, 4, 4, 100, 100, 64, 64, True, 0, 0, None),
    (2, 6, 2, 77, 77, 64, 64, True, 0, 0, None),  # GQA
    (1, 2, 2, 33, 90, 64, 64, True, 57, 0, None),  # chunked prefill: queries at an offset
    (1, 2, 1, 130, 130, 80, 80, True, 0, 17, None),  # sliding window
    (1, 3, 1, 40, 120, 32, 32, True, 80, 30, None),  # window and offset
    (2, 2, 2, 50, 60, 128, 128, False, 0, 0, None),
    (2, 3, 3, 9, 40, 64, 64, True, 31, 0, [40, 25]),  # per-sequence key lengths
    (2, 2, 1, 20, 20, 16, 16, True, 0, 0, [0, 20]),  # a sequence with no keys: zeros
    (1, 1, 1, 1, 50, 64, 64, True, 49, 0, None),  # one query (decode-like)
    (1, 2, 2, 20, 20, 96, 96, True, 0, 0, None),
    (1, 2, 2, 16, 16, 8, 8, True, 0, 0, None),
    (1, 2, 2, 25, 25, 24, 40, True, 0, 0, None),  # value dim differs from the key dim
    (1, 1, 1, 10, 20, 16, 16, True, 40, 5, None),  # every query's window lies past the last key: zeros
]


@pytest.mark.parametrize("pack_kv", [False, True], ids=["in-place", "packed"])
@pytest.mark.parametrize("block_k", [5, 32, 128])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:10])))
def test_matches_the_fp64_reference(isa_and_dtype, case, block_k, pack_kv):
    """pack_kv (fp32: K and V copied into tile order first; bf16 ignores it) meets the same reference: key counts
    that end mid-tile, windows that start mid-tile, offsets and per-sequence lengths included."""
    _, dtype = isa_and_dtype
    b, hq, hkv, sq, skv, d, dv, causal, q_offset, window, lengths = case
    q, k, v = _qkv(b, hq, hkv, sq, skv, d, dv, dtype=dtype)
    kv_len = None if lengths is None else torch.tensor(lengths)
    out = _run(q, k, v, kv_len, causal=causal, q_offset=q_offset, window=window, block_k=block_k, pack_kv=pack_kv)
    expected = _reference(q, k, v, kv_len, causal=causal, q_offset=q_offset, window=window)
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_bf16_needs_the_avx512_bf16_kernels(native_isa):
    q, k, v = _qkv(1, 2, 2, 20, 20, 16, dtype=torch.bfloat16)
    if native_isa == "avx512_bf16":
        assert torch.bfloat16 in _native.attention_dtypes()
        _run(q, k, v, causal=True)
    else:  # the lowering asks attention_dtypes() first; the operator itself refuses, never runs the wrong kernel
        assert torch.bfloat16 not in _native.attention_dtypes()
        out = torch.full_like(q, 7.0)
        with pytest.raises(ValueError, match=f"bf16 attention needs the avx512_bf16 kernels; this process runs "
                                             f"{native_isa}"):
            torch.ops.ttftc_native.attention(q, k, v, out, None, True, 0.25, 0, 0, 32, 1, False)
        assert bool((out == 7.0).all())


def test_large_scores_stay_finite_and_exact():
    """Scores in the hundreds: the online softmax must rescale, not overflow. fp32 scores of that size carry
    rounding errors near 3e-5 before any kernel arithmetic (ATen's flash kernel shows the same), hence 1e-4."""
    q, k, v = _qkv(1, 2, 2, 70, 70, 32, seed=4)
    q = q * 40
    out = _run(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _reference(q, k, v, causal=True), atol=1e-4, rtol=1e-4)


def test_results_do_not_depend_on_the_thread_count():
    """Each query block is one work item on one thread: the thread count changes who computes it, not how."""
    q, k, v = _qkv(2, 4, 2, 150, 150, 64, seed=5)
    one = _run(q, k, v, causal=True, threads=1)
    three = _run(q, k, v, causal=True, threads=3)
    assert torch.equal(one, three)


@pytest.mark.parametrize("q_heads, heads, queries, head_dim, packed", [
    (16, 16, 128, 64, True), (16, 16, 127, 64, False), (8, 8, 200, 64, False), (1, 1, 128, 1024, False),
    (32, 16, 64, 64, True)])  # GQA: 64 rows x 2 query heads per kv head read each key
def test_the_lowering_packs_kv_rows_four_kib_apart_for_enough_queries(monkeypatch, q_heads, heads, queries, head_dim,
                                                                      packed):
    """16 interleaved fp32 heads of 64 put K/V rows 4 KiB apart, in the same L1 sets: the lowering has the kernel copy
    them into tile order once 128 queries (rows x heads per kv head) read each key; 8 heads (2 KiB) read in place,
    and so do rows of 4 KiB that follow each other (one head of 1024: nothing interleaved)."""
    monkeypatch.setitem(cpu_attention.DEFAULT_TUNING, "kernel", "native")
    q, k, v = _qkv(1, q_heads, heads, queries, queries, head_dim, seed=6)
    assert (k.stride(2) * 4 % 4096 == 0) == (heads * head_dim == 1024)
    seen = []
    real = _native.attention
    monkeypatch.setattr(_native, "attention", lambda *a, **kw: seen.append(kw["pack_kv"]) or real(*a, **kw))
    out = attention_cpu(q, k, v, causal=True, scale=SCALE)
    assert seen == [packed]
    tolerance = 1e-5 * head_dim / 64  # fp32 dot products of head_dim terms
    torch.testing.assert_close(out.double(), _reference(q, k, v, causal=True), atol=tolerance, rtol=tolerance)


def test_the_lowering_gives_the_kernel_a_contiguous_head_dimension(monkeypatch):
    monkeypatch.setitem(cpu_attention.DEFAULT_TUNING, "kernel", "native")
    q, k, v = _qkv(1, 2, 2, 12, 12, 16)
    d_major = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v)]  # same values, strided along D
    out = attention_cpu(*d_major, causal=True, scale=SCALE)
    torch.testing.assert_close(out.double(), _reference(q, k, v, causal=True), atol=1e-5, rtol=1e-5)


def test_the_lowering_hands_the_kernel_int64_lengths(monkeypatch):
    monkeypatch.setitem(cpu_attention.DEFAULT_TUNING, "kernel", "native")
    q, k, v = _qkv(2, 2, 2, 12, 12, 16)
    kv_len = torch.tensor([12, 7], dtype=torch.int32)
    out = attention_cpu(q, k, v, kv_len, causal=True, scale=SCALE)
    torch.testing.assert_close(out.double(), _reference(q, k, v, kv_len.long(), causal=True), atol=1e-5, rtol=1e-5)


def test_the_lowering_hands_other_dtypes_and_head_dims_to_flash(monkeypatch):
    monkeypatch.setitem(cpu_attention.DEFAULT_TUNING, "kernel", "native")
    monkeypatch.setattr(_native, "attention", lambda *a, **kw: pytest.fail("native kernel on an unsupported case"))
    q, k, v = _qkv(1, 2, 2, 12, 12, 16)
    attention_cpu(q.half(), k.half(), v.half(), causal=True, scale=SCALE)
    q, k, v = _qkv(1, 2, 2, 12, 12, 12)  # 12 is not a multiple of 8
    out = attention_cpu(q, k, v, causal=True, scale=SCALE)
    torch.testing.assert_close(out.double(), _reference(q, k, v, causal=True), atol=1e-5, rtol=1e-5)


def _bad_input_cases():
    q, k, v = _qkv(1, 2, 2, 8, 8, 16)
    out = torch.empty(1, 2, 8, 16)
    good = dict(q=q, k=k, v=v, out=out, kv_len=None, block_k=8)
    d_major = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    return [
        (dict(good, q=q.double(), k=k.double(), v=v.double()),
         f"the native attention kernel runs {', '.join(map(str, _native.attention_dtypes()))} here, not torch.float64"),
        (dict(good, out=out[..., :8]), "out must be torch.float32 (1, 2, 8, 16), got torch.float32 (1, 2, 8, 8)"),
        (dict(good, q=d_major), "q, k, v and out need a contiguous last dimension"),
        (dict(good, kv_len=torch.tensor([8], dtype=torch.int32)),
         "kv_len must be a contiguous int64 tensor of shape (1,)"),
        (dict(good, kv_len=torch.tensor([8, 8])), "kv_len must be a contiguous int64 tensor of shape (1,)"),
        (dict(good, k=k[:, :0], v=v[:, :0]), "query heads are not a multiple of kv heads"),
        (dict(good, block_k=0), f"block_k must be in [1, {_native.MAX_BLOCK_K}], got 0"),
        (dict(good, block_k=2**61), f"block_k must be in [1, {_native.MAX_BLOCK_K}], got {2**61}"),
        (dict(good, block_k=8.0), "block_k must be an int, got float 8.0"),
        (dict(good, q_offset=-1), f"q_offset must be in [0, {_native.MAX_POSITION}], got -1"),
        (dict(good, q_offset=_native.MAX_POSITION), f"positions past {_native.MAX_POSITION} (the masks compare "
                                                     "positions as fp32)"),
        (dict(good, window=-1), f"window must be in [0, {2**63 - 1}], got -1"),
        (dict(good, threads=0), f"threads must be in [1, {_native.MAX_THREADS}], got 0"),
        (dict(good, threads=True), "threads must be an int, got bool True"),
        (dict(good, out=out.to("meta")), "attention: out is on meta, not the CPU"),
        (dict(good, kv_len=torch.tensor([8], device="meta")), "attention: kv_len is on meta, not the CPU"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_input_cases())))
def test_bad_inputs_are_refused_before_any_pointer_is_used(case):
    args, message = _bad_input_cases()[case]
    with pytest.raises(ValueError) as refused:
        _native.attention(args["q"], args["k"], args["v"], args["out"], args["kv_len"], causal=True, scale=1.0,
                          q_offset=args.get("q_offset", 0), window=args.get("window", 0), block_k=args["block_k"],
                          threads=args.get("threads", 1))
    assert str(refused.value) == message


def _attention_reason_cases():
    q, k, v = _qkv(2, 4, 2, 8, 8, 16)
    not_4d, misfit = "q, k, v are not 4-D", "q, k, v shapes do not fit together"
    return [((q[0], k, v), not_4d), ((q, k[0], v), not_4d), ((q, k, v[0]), not_4d),
            ((q, k[..., :8], v), misfit),  # head dims differ
            ((q, k, v[:, :, :7]), misfit),  # key and value lengths differ
            ((q, k[:1], v[:1]), misfit),  # batch sizes differ
            # q [2, 4, 10, D] and v [2, 2, 9, Dv]: no size but the head dims is 12 or 16
            (_qkv(2, 4, 2, 10, 9, 12, dv=16), "head dims 12, 16 are not multiples of 8"),
            (_qkv(2, 4, 2, 10, 9, 16, dv=12), "head dims 16, 12 are not multiples of 8"),
            (tuple(t.to("meta") for t in (q, k, v)), "tensors are not on the CPU"),
            ((q, k, v), None)]


@pytest.mark.parametrize("case", range(len(_attention_reason_cases())))
def test_attention_reason_names_each_misfit(case):
    tensors, reason = _attention_reason_cases()[case]
    assert _native.attention_reason(*tensors) == reason


def test_attention_reason_without_the_extension_says_why(monkeypatch):
    monkeypatch.setattr(_native, "unavailable_reason", lambda: "the native kernels are not built")
    assert _native.attention_reason(*_qkv(1, 2, 2, 8, 8, 16)) == "the native kernels are not built"


def test_without_the_extension_there_is_no_isa_and_no_native_attention_dtype(monkeypatch):
    monkeypatch.setattr(_native, "_load", lambda: (None, "no native module in this build"))
    assert _native.isa() is None
    assert _native.attention_dtypes() == ()


def test_the_native_attention_runs_bf16_only_with_avx512_bf16(native_isa):
    bf16 = (torch.bfloat16,) if native_isa == "avx512_bf16" else ()
    assert _native.attention_dtypes() == (torch.float32, *bf16)


def test_native_calls_are_named_ranges_in_the_torch_profiler():
    q, k, v = _qkv(1, 2, 2, 8, 8, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        _run(q, k, v, causal=True)
    assert "ttftc_native::attention" in {event.name for event in profile.events()}


def test_blocks_of_one_key_and_no_queries_are_valid():
    q, k, v = _qkv(1, 2, 2, 9, 9, 16)
    torch.testing.assert_close(_run(q, k, v, causal=True, block_k=1).double(), _reference(q, k, v, causal=True),
                               atol=1e-5, rtol=1e-5)
    assert _run(q[:, :, :0], k, v, causal=True).shape == (1, 2, 0, 16)


def test_a_build_from_other_sources_is_refused(monkeypatch):
    _native._load.cache_clear()
    try:
        monkeypatch.setattr(_native, "source_digest", lambda directory=_native.CSRC: "0" * 64)
        assert _native.unavailable_reason() == (
            "native kernels were built from other sources than csrc/ holds now; rebuild: pip install -e .")
        assert "native" not in cpu_attention.kernels_for(torch.float32)
    finally:
        monkeypatch.undo()
        _native._load.cache_clear()
    assert _native.unavailable_reason() is None or platform.system() != "Linux"


def test_the_digest_of_the_sources_is_the_one_the_module_was_built_with():
    # the built module itself, not through _load, which compares the two once and then caches its answer
    module = pytest.importorskip("ttftc.codegen.cpu._native_kernels")
    assert _native.source_digest() == module.source_digest()


def _fake_maps(monkeypatch, *paths):
    """/proc/self/maps listing these mapped files (and only that file may be opened)."""
    lines = "".join(f"7f0000000000-7f0000001000 r-xp 00000000 08:01 1234  {p}\n" for p in paths)

    def fake_open(path, *args, **kwargs):
        if path != "/proc/self/maps":
            raise FileNotFoundError(path)
        return io.StringIO(lines)

    monkeypatch.setattr(_native, "open", fake_open, raising=False)


@pytest.mark.parametrize("runtime", ["/opt/intel/libiomp5.so", "/usr/lib/libgomp.so.1", "/usr/lib/libgomp-a1b2.so.5"])
def test_the_openmp_runtime_is_found_by_its_name_in_the_memory_map(monkeypatch, runtime):
    _fake_maps(monkeypatch, "/usr/lib/libc.so.6", "/usr/lib/libm.so", runtime, "/usr/lib/libgomp_notes.txt")
    assert _native._loaded_openmp() == runtime


def test_no_openmp_runtime_in_the_memory_map_means_none(monkeypatch):
    _fake_maps(monkeypatch, "/usr/lib/libc.so.6", "/usr/lib/libm.so", "/usr/lib/libgomp.a")
    assert _native._loaded_openmp() is None


def _isas_this_cpu_has() -> list[str]:
    """The kernel versions this CPU's flags allow (the C++ detect_isa's rule, read from /proc/cpuinfo instead).

    Not native_isas_here(): that follows the version running now, which TTFTC_NATIVE_ISA=avx2 lowers below what
    the CPU has, and set_isa goes back up to anything the CPU has."""
    flags, _ = cpu_flags_and_name()
    if flags is None:
        pytest.skip("no /proc/cpuinfo to tell which instruction sets this CPU has")
    has = ["base"]
    if {"avx2", "fma"} <= flags:
        has.append("avx2")
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags:
        has[1:] = ["avx2", "avx512"] + (["avx512_bf16"] if "avx512_bf16" in flags else [])
    return has


def test_set_isa_refuses_what_this_cpu_lacks_or_does_not_know():
    if _native.unavailable_reason() is not None:
        pytest.skip(_native.unavailable_reason())
    with pytest.raises(ValueError, match="unknown instruction set"):
        _native.set_isa("sse9")
    has = _isas_this_cpu_has()
    previous = _native.isa()
    try:
        for name in NATIVE_ISAS:
            if name in has:
                _native.set_isa(name)
                assert _native.isa() == name
            else:
                with pytest.raises(ValueError, match=re.escape(f"this CPU does not run {name} (best: {has[-1]})")):
                    _native.set_isa(name)
    finally:
        _native.set_isa(previous)


def test_set_isa_without_the_module_says_why(monkeypatch):
    monkeypatch.setattr(_native, "_load", lambda: (None, "no native module in this build"))
    with pytest.raises(RuntimeError) as refused:
        _native.set_isa("base")
    assert str(refused.value) == "no native module in this build"


@pytest.mark.parametrize("runtime", ["/opt/lib/libgomp.so.1", None])
def test_the_kernels_join_torchs_openmp_runtime_where_there_is_one(monkeypatch, runtime):
    module = pytest.importorskip("ttftc.codegen.cpu._native_kernels")
    joined = []
    _native._load.cache_clear()
    try:
        monkeypatch.setattr(module, "use_openmp", joined.append)
        monkeypatch.setattr(_native, "_loaded_openmp", lambda: runtime)
        assert _native._load() == (module, None)
    finally:
        monkeypatch.undo()
        _native._load.cache_clear()
    assert joined == ([runtime] if runtime else [])

