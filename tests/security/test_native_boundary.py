"""Issue 33, findings 1 and 2: the native kernels' boundary. A count that sizes memory (block_k, threads) or a tensor
whose data is not in CPU memory (a meta tensor's data_ptr() is 0) is a ValueError in Python before any pointer is
taken; the operators check every tensor again, and their own size arithmetic and allocations (torch.OutOfMemoryError),
never abort.

Before: block_k=2**61 made Scratch::reserve's int64 products wrap (`free(): invalid next size`, an abort), 2**40
made aligned_alloc fail unchecked (a segfault), and a meta `out`, weight, residual or scale was written or read
through a null pointer.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.codegen.conftest import NATIVE_ISAS, native_isas_here
from ttftc.codegen.cpu import _native

pytestmark = pytest.mark.skipif(_native.unavailable_reason() is not None, reason=str(_native.unavailable_reason()))

# 2**61: the products of Scratch::reserve wrapped; 2**40: they did not, and the allocation failed unchecked;
# 2**64: no C int64 holds it.
HUGE_COUNTS = (2**61, 2**40, 2**64)


def _qkv(skv: int = 16):
    q, k, v = (torch.randn(1, 2, skv, 16) for _ in range(3))
    return q, k, v, torch.empty_like(q)


def _attend(q, k, v, out, kv_len=None, **counts):
    params = {**dict(causal=True, scale=0.25, q_offset=0, window=0, block_k=32, threads=1), **counts}
    return _native.attention(q, k, v, out, kv_len, **params)


@pytest.mark.parametrize("block_k", HUGE_COUNTS + (0, -1))
def test_a_block_k_out_of_range_is_a_value_error(block_k):
    with pytest.raises(ValueError, match=rf"^block_k must be in \[1, {_native.MAX_BLOCK_K}\], got {block_k}$"):
        _attend(*_qkv(), block_k=block_k)


@pytest.mark.parametrize("threads", HUGE_COUNTS + (0,))
def test_a_thread_count_out_of_range_is_a_value_error(threads):
    with pytest.raises(ValueError, match=r"^threads must be in \[1, "):
        _attend(*_qkv(), threads=threads)


def test_a_block_past_the_keys_is_one_block_of_all_of_them():
    """Up to max(Skv, MAX_BLOCK_K) is taken, and the C++ side clamps it to the keys: the same result as Skv."""
    q, k, v, out = _qkv(skv=40)
    expected = _attend(q, k, v, torch.empty_like(out), block_k=40).clone()
    assert torch.equal(_attend(q, k, v, out, block_k=_native.MAX_BLOCK_K), expected)
    q, k, v, out = _qkv(skv=_native.MAX_BLOCK_K + 8)
    with pytest.raises(ValueError, match="block_k must be in"):
        _attend(q, k, v, out, block_k=_native.MAX_BLOCK_K + 9)


def test_a_window_past_every_position_is_the_same_as_no_limit():
    q, k, v, out = _qkv()
    whole = _attend(q, k, v, torch.empty_like(out), window=16).clone()
    assert torch.equal(_attend(q, k, v, out, window=2**62), whole)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


_X, _W, _ACC = torch.randn(4, 8), torch.ones(8), torch.zeros(4, 8, dtype=torch.int32)
# Every tensor operand of every wrapper, one at a time on the meta device.
META_CALLS = {
    "attention out": lambda: _attend(*_qkv()[:3], _meta(_qkv()[3])),
    "attention kv_len": lambda: _attend(*_qkv(), kv_len=_meta(torch.tensor([16]))),
    "attention q": lambda: _attend(_meta(_qkv()[0]), *_qkv()[1:]),
    "norm weight": lambda: _native.norm(_X, _meta(_W), None, None, layer=False, eps=1e-5),
    "norm residual": lambda: _native.norm(_X, _W, None, _meta(_X), layer=False, eps=1e-5),
    "layer norm bias": lambda: _native.norm(_X, _W, _meta(_W), None, layer=True, eps=1e-5),
    "norm_quant weight": lambda: _native.norm_quant(_X, _meta(_W), None, None, layer=False, eps=1e-5),
    "quantize_rows x": lambda: _native.quantize_rows(_meta(_X)),
    "gated_act x": lambda: _native.gated_act(_meta(_X), "silu"),
    "dequant acc": lambda: _native.dequant(_meta(_ACC), torch.ones(4), _W, None, torch.float32),
    "dequant x_scale": lambda: _native.dequant(_ACC, _meta(torch.ones(4)), _W, None, torch.float32),
    "dequant w_scale": lambda: _native.dequant(_ACC, torch.ones(4), _meta(_W), None, torch.float32),
    "dequant bias": lambda: _native.dequant(_ACC, torch.ones(4), _W, _meta(_W), torch.float32),
    "gated_quant acc": lambda: _native.gated_quant(_meta(_ACC), torch.ones(4), _W, None, "silu"),
    "gated_quant w_scale": lambda: _native.gated_quant(_ACC, torch.ones(4), _meta(_W), None, "silu"),
    "rope out": lambda: _native.rope(_qkv()[0], _qkv()[0], _qkv()[0], _meta(_qkv()[0])),
    "rope cos": lambda: _native.rope(_qkv()[0], _meta(_qkv()[0]), _qkv()[0], _qkv()[0]),
}


@pytest.mark.parametrize("operand", sorted(META_CALLS))
def test_a_meta_tensor_is_refused_before_its_null_pointer_is_taken(operand):
    with pytest.raises(ValueError, match="meta|not on the CPU|must match x"):
        META_CALLS[operand]()


# -- the operators themselves (torch.ops.ttftc_native.*), past the wrappers' checks --------------------------------

ops = torch.ops.ttftc_native

# The former int-tuple entry points' negative sizes (a query count of -1, a row kernel's -1 rows or -8 columns) and
# head dims of 2**40 or 2**61 cannot reach the C++ side any more: a tensor's sizes are non-negative and its
# unit-stride dimensions fit its storage. Its size checks, its allocation check and block_k's clamp stay reachable,
# as below (the clamp's test is tests/codegen/cpu/test_native_ops.py::test_a_huge_block_is_clamped_to_the_keys).

_OOM_PROBE = """
import resource, torch
from ttftc.codegen.cpu import _native
assert _native.unavailable_reason() is None, _native.unavailable_reason()
q = torch.randn(1, 1, 8, 16)
keys = torch.randn(1, 1, 1, 16).expand(1, 1, _native.MAX_POSITION, 16)  # 2**24 keys, one row of memory
out = torch.full_like(q, 7.0)
with open("/proc/self/status") as status:
    vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, ((vm_kib << 10) + (256 << 20),) * 2)
try:
    torch.ops.ttftc_native.attention(q, keys, keys, out, None, False, 0.25, 0, 0, _native.MAX_POSITION, 1, False)
except torch.OutOfMemoryError as exc:
    print("refused:", "working memory of a thread cannot be allocated" in str(exc), bool((out == 7.0).all()))
else:
    print("ran")
"""


def test_the_cpp_side_checks_its_own_allocation():
    """A block of 2**24 keys (broadcast, no memory of their own) needs gigabytes of working memory per thread, more
    than this process may map: torch.OutOfMemoryError, the output untouched, the process alive (was an unchecked
    aligned_alloc and a segfault)."""
    run = subprocess.run([sys.executable, "-c", _OOM_PROBE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["refused:", "True", "True"]


def _attention_op(**changes):
    q = torch.randn(1, 2, 8, 16)
    args = dict(q=q, k=q, v=q, out=torch.empty_like(q), kv_len=None, causal=True, scale=0.25, q_offset=0, window=0,
                block_k=8, threads=1, pack_kv=False)
    return ops.attention(**{**args, **changes})


@pytest.mark.parametrize("changes, message", [
    (dict(block_k=-(2**62)), "block_k"), (dict(k=torch.randn(1, 0, 8, 16), v=torch.randn(1, 0, 8, 16)), "kv heads"),
    (dict(q_offset=-5), "positions"), (dict(window=-(2**62)), "negative"), (dict(threads=-1), "threads"),
    (dict(threads=2**31), "threads")])
def test_the_cpp_side_refuses_counts_out_of_range_with_a_value_error(changes, message):
    with pytest.raises(ValueError, match=message):
        _attention_op(**changes)


@pytest.mark.parametrize("count", ["q_offset", "window", "block_k", "threads"])
def test_no_count_past_int64_reaches_the_cpp_side(count):
    """The schema's int is a C int64: the dispatcher refuses 2**64 before the kernel sees a wrapped value."""
    with pytest.raises(RuntimeError, match="Expected a value of type 'int'"):
        _attention_op(**{count: 2**64})


_X4 = torch.randn(1, 2, 4, 8)
_GEMM_X, _GEMM_W = torch.ones(4, 12, dtype=torch.int8), torch.ones(10, 12, dtype=torch.int8)
# What each operator writes, (shape, dtype, call(output)): every output a kernel writes through a raw pointer.
OUTPUTS = {
    "quantize_rows q": ((4, 8), torch.int8, lambda o: ops.quantize_rows(_X, o, torch.empty(4), 1)),
    "quantize_rows scale": ((4,), torch.float32,
                            lambda o: ops.quantize_rows(_X, torch.empty(4, 8, dtype=torch.int8), o, 1)),
    "norm out": ((4, 8), torch.float32, lambda o: ops.norm(_X, None, None, _W, None, None, None, o, False, 1e-5, 1)),
    "norm summed": ((4, 8), torch.float32,
                    lambda o: ops.norm(_X, _X, o, _W, None, None, None, torch.empty(4, 8), False, 1e-5, 1)),
    "norm q": ((4, 8), torch.int8,
               lambda o: ops.norm(_X, None, None, _W, None, o, torch.empty(4), None, False, 1e-5, 1)),
    "gated_act out": ((4, 4), torch.float32, lambda o: ops.gated_act(_X, o, "silu", 1)),
    "dequant out": ((4, 8), torch.float32, lambda o: ops.dequant(_ACC, torch.ones(4), _W, None, o, 1)),
    "gated_quant q": ((4, 4), torch.int8,
                      lambda o: ops.gated_quant(_ACC, torch.ones(4), _W, None, o, torch.empty(4), "silu", 1)),
    "rope out": ((1, 2, 4, 8), torch.float32, lambda o: ops.rope(_X4, _X4, _X4, o, 1)),
    "attention out": ((1, 2, 4, 8), torch.float32,
                      lambda o: ops.attention(_X4, _X4, _X4, o, None, True, 0.25, 0, 0, 8, 1, False)),
    "int8_gemm out": ((4, 10), torch.int32, lambda o: ops.int8_gemm(
        _GEMM_X, _native.pack_int8_weight(_GEMM_W), None, None, None, o, 64, 2, 1)),
}


def _short(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """One row (or element) fewer than the kernel writes."""
    return torch.full((*shape[:-2], shape[-2] - 1, shape[-1]) if len(shape) > 1 else (shape[0] - 1,), 7, dtype=dtype)


def _strided(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The right shape, with its last dimension strided (its last two transposed)."""
    return torch.full((*shape[:-2], shape[-1], shape[-2]), 7, dtype=dtype).transpose(-1, -2)


@pytest.mark.parametrize("output, layout", [(name, layout) for name in sorted(OUTPUTS) for layout in (_short, _strided)
                                            if layout is _short or len(OUTPUTS[name][0]) > 1])
def test_an_output_that_does_not_hold_what_the_kernel_writes_is_refused_untouched(output, layout):
    """Where the former int tuples took a count apart from the buffer (and a negative one), the operators size what
    they write from the tensors they are handed: an output too short or not laid out in rows is refused, unwritten."""
    shape, dtype, call = OUTPUTS[output]
    out = layout(shape, dtype)
    with pytest.raises(ValueError):
        call(out)
    assert bool((out == 7).all())


# -- issue 40: the operators' own thread cap, -128 in a packed weight, a non-finite attention scale ----------------

INT_MAX = 2**31 - 1


def test_the_operators_and_the_wrappers_share_one_thread_cap():
    """csrc/native.cpp's kMaxThreads, as the module reports it, is the cap the wrappers check (MAX_THREADS)."""
    from ttftc.codegen.cpu import _native_kernels

    assert _native_kernels.max_threads() == _native.MAX_THREADS


# Every operator's call with a given thread count, over a few work items (so the old code, which took up to INT_MAX,
# started no more threads than it could here).
_SMALL_CALLS = {
    "attention": lambda t: ops.attention(_X4, _X4, _X4, torch.empty_like(_X4), None, True, 0.25, 0, 0, 8, t, False),
    "quantize_rows": lambda t: ops.quantize_rows(_X, torch.empty(4, 8, dtype=torch.int8), torch.empty(4), t),
    "norm": lambda t: ops.norm(_X, None, None, _W, None, None, None, torch.empty(4, 8), False, 1e-5, t),
    "gated_act": lambda t: ops.gated_act(_X, torch.empty(4, 4), "silu", t),
    "dequant": lambda t: ops.dequant(_ACC, torch.ones(4), _W, None, torch.empty(4, 8), t),
    "gated_quant": lambda t: ops.gated_quant(_ACC, torch.ones(4), _W, None, torch.empty(4, 4, dtype=torch.int8),
                                             torch.empty(4), "silu", t),
    "rope": lambda t: ops.rope(_X4, _X4, _X4, torch.empty_like(_X4), t),
    "int8_gemm": lambda t: ops.int8_gemm(_GEMM_X, _native.pack_int8_weight(_GEMM_W), None, None, None,
                                         torch.empty(4, 10, dtype=torch.int32), 64, 2, t),
}


@pytest.mark.parametrize("op", sorted(_SMALL_CALLS))
def test_every_operator_refuses_threads_past_the_cap_and_takes_the_cap(op):
    with pytest.raises(ValueError, match=rf"^{op}: threads must be in \[1, {_native.MAX_THREADS}\]"):
        _SMALL_CALLS[op](_native.MAX_THREADS + 1)
    _SMALL_CALLS[op](_native.MAX_THREADS)  # the kernels start no more threads than they have work items


_THREADS_PROBE = """
import resource, sys, torch
from ttftc.codegen.cpu import _native
assert _native.unavailable_reason() is None, _native.unavailable_reason()
ops = torch.ops.ttftc_native
# Thousands of work items per call: asked for INT_MAX threads, a kernel would ask the OpenMP team for all of them.
rows = 8 * 4096
x, w, acc = torch.randn(rows, 8), torch.ones(8), torch.zeros(rows, 8, dtype=torch.int32)
heads = torch.randn(1, 4096, 1, 8)
gemm_x, packed = torch.ones(rows, 4, dtype=torch.int8), _native.pack_int8_weight(torch.ones(8, 4, dtype=torch.int8))
calls = {
    "attention": lambda t: ops.attention(heads, heads, heads, torch.empty_like(heads), None, False, 0.25, 0, 0, 8, t,
                                         False),
    "quantize_rows": lambda t: ops.quantize_rows(x, torch.empty(rows, 8, dtype=torch.int8), torch.empty(rows), t),
    "norm": lambda t: ops.norm(x, None, None, w, None, None, None, torch.empty(rows, 8), False, 1e-5, t),
    "gated_act": lambda t: ops.gated_act(x, torch.empty(rows, 4), "silu", t),
    "dequant": lambda t: ops.dequant(acc, torch.ones(rows), w, None, torch.empty(rows, 8), t),
    "gated_quant": lambda t: ops.gated_quant(acc, torch.ones(rows), w, None, torch.empty(rows, 4, dtype=torch.int8),
                                             torch.empty(rows), "silu", t),
    "rope": lambda t: ops.rope(heads, heads, heads, torch.empty_like(heads), t),
    "int8_gemm": lambda t: ops.int8_gemm(gemm_x, packed, None, None, None, torch.empty(rows, 8, dtype=torch.int32), 1,
                                         1, t),
}
# Little address space left for thread stacks: where the old code let INT_MAX through, libgomp failed to create the
# team at once and exited the process ("libgomp: Thread creation failed"), rather than after thousands of threads.
with open("/proc/self/status") as status:
    vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, ((vm_kib << 10) + (512 << 20),) * 2)
for name, call in calls.items():
    try:
        call(int(sys.argv[1]))
    except ValueError as exc:
        print(name, "refused", f"threads must be in [1, {_native.MAX_THREADS}]" in str(exc))
    else:
        print(name, "ran")
"""


def test_a_thread_count_of_int_max_is_refused_by_every_operator_never_exits_the_process():
    """Issue 40, finding 2: the operators took threads up to INT_MAX, and over enough work items libgomp could not
    create the team and exited the process. Each now refuses past its cap with a ValueError naming it; the process
    exits cleanly."""
    run = subprocess.run([sys.executable, "-c", _THREADS_PROBE, str(INT_MAX)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(run.stdout.splitlines()) == [f"{name} refused True" for name in sorted(_SMALL_CALLS)], run.stdout


@pytest.fixture(params=NATIVE_ISAS)
def every_isa(request):
    """Once per instruction-set version of the kernels this CPU runs (the AVX-512 ones run int8_gemm's VNNI version
    where the CPU has it)."""
    if request.param not in native_isas_here():
        pytest.skip(f"this CPU does not run the {request.param} kernels")
    previous = _native.set_isa(request.param)
    yield request.param
    _native.set_isa(previous)


def _packed_with_minus_128(n: int, k: int, where: str) -> torch.Tensor:
    """A valid packed weight with one byte at -128: the first, the last, or one in the middle of a middle panel."""
    packed = _native.pack_int8_weight(torch.randint(-127, 128, (n, k), dtype=torch.int8,
                                                    generator=torch.Generator().manual_seed(n * k)))
    flat = packed.view(-1)
    flat[{"first": 0, "last": flat.numel() - 1, "middle": flat.numel() // 2 + 5}[where]] = -128
    return packed


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("m, block_rows, threads", [(1, 64, 1), (9, 4, 1), (70, 64, 2), (130, 3, 2)])
def test_the_gemm_operator_refuses_a_packed_weight_holding_minus_128(every_isa, where, m, block_rows, threads):
    """Issue 40, finding 8: the kernel negates weights (x's sign moves onto them), and -(-128) is no int8, so such a
    weight gave wrong numbers silently when it reached the operator without pack_int8_weight's check. The operator
    now raises, whatever the row count, the work split or the byte's place."""
    n, k = 64, 36
    xq = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=torch.Generator().manual_seed(m))
    packed = _packed_with_minus_128(n, k, where)
    out = torch.empty(m, n, dtype=torch.int32)
    with pytest.raises(ValueError, match="packed weight holds -128"):
        ops.int8_gemm(xq, packed, None, None, None, out, block_rows, 2, threads)
    with pytest.raises(ValueError, match="packed weight holds -128"):  # dequantised, through the wrapper
        _native.int8_gemm(xq, packed, n, torch.ones(m), torch.ones(n), out_dtype=torch.float32)


def test_the_gemm_operator_still_takes_minus_127_everywhere(every_isa):
    """The check is for -128 alone: a weight of all -127 against activations of all -128 is exact."""
    w = torch.full((16, 8), -127, dtype=torch.int8)
    xq = torch.full((5, 8), -128, dtype=torch.int8)
    out = torch.empty(5, 16, dtype=torch.int32)
    ops.int8_gemm(xq, _native.pack_int8_weight(w), None, None, None, out, 64, 2, 1)
    assert torch.equal(out, torch._int_mm(xq, w.t()))


def _sdpa_math(q, k, v, *, causal, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # SDPA's definition; the CPU flash backend drops a NaN scale to zeros
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("causal, kv_len", [(False, None), (True, None), (True, (3,))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_attention_scale_gives_nan_as_sdpa_does(scale, causal, kv_len, dtype):
    """Issue 40, finding 8: the kernel's softmax skipped NaN scores, so a NaN scale gave zeros. SDPA multiplies every
    score by the scale: a NaN or infinite one makes every output NaN, and so does the operator now, on the wrapper's
    path and the operator's."""
    if dtype not in _native.attention_dtypes():
        pytest.skip(f"the native attention kernel runs {_native.attention_dtypes()} here")
    q = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    lengths = None if kv_len is None else torch.tensor(kv_len)
    expected = _sdpa_math(q.float(), q.float(), q.float(), causal=causal, scale=scale)
    assert bool(expected.isnan().all())
    out = torch.zeros_like(q)
    ops.attention(q, q, q, out, lengths, causal, scale, 0, 0, 8, 1, False)
    assert bool(out.isnan().all())
    wrapped = _attend(q, q, q, torch.zeros_like(q), lengths, causal=causal, scale=scale)
    assert bool(wrapped.isnan().all())
