"""The reference implementations are the oracle for every kernel, so they are checked against independent math."""

import pytest
import torch
import torch.nn.functional as F

import ttftc.ops  # noqa: F401
from ttftc.ops import get_op
from ttftc.ops.attention import allowed_pairs
from ttftc.ops.int8_linear import quantize_per_token

ops = torch.ops.ttftc


def _naive_attention(q, k, v, mask):
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, -1), nan=0.0) @ v


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("q_offset", [0, 5])
def test_attention_causal_with_offset_and_gqa(group, q_offset):
    torch.manual_seed(0)
    sq, skv = 7, 7 + q_offset
    q = torch.randn(2, 2 * group, sq, 8)
    k, v = torch.randn(2, 2, skv, 8), torch.randn(2, 2, skv, 8)
    out = ops.attention(q, k, v, causal=True, scale=8**-0.5, q_offset=q_offset)
    rows = torch.arange(sq)[:, None] + q_offset
    mask = torch.arange(skv)[None, :] <= rows
    torch.testing.assert_close(out, _naive_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_attention_window_and_kv_len_and_empty_rows():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    kv_len = torch.tensor([6, 3])
    out = ops.attention(q, k, v, kv_len, causal=True, scale=0.5, window=2)
    rows, cols = torch.arange(6)[:, None], torch.arange(6)[None, :]
    base = (cols <= rows) & (cols > rows - 2)
    for b in range(2):
        mask = base & (cols < kv_len[b])
        ref = _naive_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], mask)  # D=4: scale 0.5 is D**-0.5
        torch.testing.assert_close(out[b : b + 1], ref, atol=1e-5, rtol=1e-5)
    # Sequence 1 has 3 keys; with a window of 2, query rows 5 sees keys 4 and 5, both padding: zeros.
    assert torch.equal(out[1, :, 5], torch.zeros_like(out[1, :, 5]))


def test_attention_matches_sdpa_noncausal():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 9, 16), torch.randn(1, 4, 11, 16), torch.randn(1, 4, 11, 16)
    out = ops.attention(q, k, v, causal=False, scale=0.25)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_attention_flops_count_causal_pairs():
    assert allowed_pairs(4, 4, causal=True, q_offset=0, window=0) == 10
    assert allowed_pairs(2, 6, causal=True, q_offset=4, window=0) == 11
    assert allowed_pairs(4, 4, causal=True, q_offset=0, window=2) == 7
    q = torch.empty(1, 2, 4, 8)
    assert get_op("attention").flops(q, torch.empty(1, 2, 4, 8), q, causal=True, scale=1.0) == 4 * 2 * 10 * 8


def test_gated_ffn_matches_separate_gemms():
    torch.manual_seed(0)
    x, wg, wu, wd = torch.randn(3, 5, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    out = ops.gated_ffn(x, torch.cat([wg, wu]), wd, act="silu")
    torch.testing.assert_close(out, (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T, atol=1e-5, rtol=1e-5)
    out = ops.gated_ffn(x, torch.cat([wg, wu]), wd, act="gelu_tanh")
    ref = (F.gelu(x @ wg.T, approximate="tanh") * (x @ wu.T)) @ wd.T
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_norm_linear_rms_with_residual():
    torch.manual_seed(0)
    x, res, nw, w = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(8), torch.randn(6, 8)
    out, new_res = ops.norm_linear(x, nw, None, w, None, res, kind="rms", eps=1e-6)
    h = x + res
    normed = nw * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(new_res, h)
    torch.testing.assert_close(out, normed @ w.T, atol=1e-5, rtol=1e-5)


def test_norm_linear_layer_norm_with_bias():
    torch.manual_seed(0)
    x, nw, nb, w, b = torch.randn(2, 8), torch.randn(8), torch.randn(8), torch.randn(6, 8), torch.randn(6)
    out, res = ops.norm_linear(x, nw, nb, w, b, kind="layer", eps=1e-5)
    torch.testing.assert_close(out, F.layer_norm(x, (8,), nw, nb, 1e-5) @ w.T + b, atol=1e-5, rtol=1e-5)
    assert res.numel() == 0


def test_int8_linear_is_exact_integer_math():
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    w_int8 = torch.randint(-127, 128, (12, 64), dtype=torch.int8)
    w_scale = torch.rand(12) / 100
    out = ops.int8_linear(x, None, w_int8, w_scale, out_dtype=torch.float32)
    xq, xs = quantize_per_token(x)
    exact = (xq.long() @ w_int8.long().T).double() * xs.double()[:, None] * w_scale.double()[None]
    torch.testing.assert_close(out, exact.float())
    # Quantisation error is bounded: half a step per element.
    assert ((xq.float() * xs[:, None]) - x).abs().max() <= xs.max() / 2 + 1e-6


def test_fake_impls_give_shapes_without_compute():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(1, 4, 5, 8), torch.empty(1, 2, 7, 8)
        assert ops.attention(q, k, k, causal=True, scale=1.0, q_offset=2).shape == (1, 4, 5, 8)
        x = torch.empty(3, 8)
        assert ops.gated_ffn(x, torch.empty(32, 8), torch.empty(8, 16), act="silu").shape == (3, 8)
        out, res = ops.norm_linear(x, torch.empty(8), None, torch.empty(12, 8), kind="rms", eps=1e-6)
        assert out.shape == (3, 12) and res.numel() == 0
