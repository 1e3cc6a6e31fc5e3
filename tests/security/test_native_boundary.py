"""Issue 33, findings 1 and 2: the native kernels' boundary. A count that sizes memory (block_k, threads) or a tensor
whose data is not in CPU memory (a meta tensor's data_ptr() is 0) is a ValueError in Python before any pointer is
taken; the C++ side checks its own size arithmetic and allocations and raises MemoryError, never aborts.

Before: block_k=2**61 made Scratch::reserve's int64 products wrap (`free(): invalid next size`, an abort), 2**40
made aligned_alloc fail unchecked (a segfault), and a meta `out`, weight, residual or scale was written or read
through a null pointer.
"""

from __future__ import annotations

import pytest
import torch

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


def _raw_attention_ints(q, out, **override) -> tuple:
    """The 31 integers the C++ entry point takes (native.cpp: attention), for q = k = v, with some overridden."""
    fields = dict(b=q.shape[0], hq=q.shape[1], hkv=q.shape[1], sq=q.shape[2], skv=q.shape[2], d=q.shape[3],
                  dv=q.shape[3], q_offset=0, window=0, block_k=8, threads=1)
    fields.update(override)
    strides = (*q.stride()[:3],) * 3 + (*out.stride()[:3],)
    return (q.data_ptr(), q.data_ptr(), q.data_ptr(), out.data_ptr(), 0, fields["b"], fields["hq"], fields["hkv"],
            fields["sq"], fields["skv"], fields["d"], fields["dv"], *strides, 1, fields["q_offset"], fields["window"],
            fields["block_k"], fields["threads"], 0, 0)


@pytest.mark.parametrize("d", [2**61, 2**40])
def test_the_cpp_side_checks_its_own_size_arithmetic_and_allocation(d):
    """Past the Python checks (the raw entry point): a working-memory size that overflows (2**61 x 48 floats) or
    cannot be allocated (2**40 x 48 floats) is a MemoryError, and the kernel touches no memory."""
    q, out = torch.randn(1, 1, 8, 16), torch.empty(1, 1, 8, 16)
    with pytest.raises(MemoryError, match="working memory of a thread cannot be allocated"):
        _native._load()[0].attention(_raw_attention_ints(q, out, d=d), 0.25)


@pytest.mark.parametrize("override, message", [
    (dict(block_k=0), "block_k"), (dict(block_k=-(2**62)), "block_k"), (dict(hkv=0), "kv heads"),
    (dict(sq=-1), "negative"), (dict(q_offset=-5), "negative"), (dict(threads=0), "threads"),
    (dict(threads=2**40), "threads")])
def test_the_cpp_side_refuses_counts_out_of_range_with_a_value_error(override, message):
    q, out = torch.randn(1, 1, 8, 16), torch.empty(1, 1, 8, 16)
    with pytest.raises(ValueError, match=message):
        _native._load()[0].attention(_raw_attention_ints(q, out, **override), 0.25)


def test_the_cpp_side_clamps_a_huge_block_to_the_keys():
    """block_k = 2**61 straight into C++: clamped to the keys, the same result as a block of all of them."""
    q, out = torch.randn(1, 1, 8, 16), torch.empty(1, 1, 8, 16)
    module = _native._load()[0]
    module.attention(_raw_attention_ints(q, out, block_k=8), 0.25)
    expected = out.clone()
    module.attention(_raw_attention_ints(q, out, block_k=2**61), 0.25)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("kernel, ints", [
    ("quantize_rows", lambda x, y: (x.data_ptr(), 0, 8, y.data_ptr(), y.data_ptr(), -1, 8, 1)),
    ("gated_act", lambda x, y: (x.data_ptr(), 8, y.data_ptr(), 4, -4, 0, 0, 1)),
    ("dequant", lambda x, y: (x.data_ptr(), 8, y.data_ptr(), y.data_ptr(), 0, y.data_ptr(), 8, 4, -8, 0, 1))])
def test_the_cpp_row_kernels_refuse_negative_sizes(kernel, ints):
    x, y = torch.zeros(4, 8), torch.zeros(64)
    with pytest.raises(ValueError, match="negative"):
        getattr(_native._load()[0], kernel)(ints(x, y))
