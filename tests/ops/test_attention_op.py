"""The reference of ttftc.attention against a dense, obviously-correct formulation (repeat K/V, full mask)."""

import pytest
import torch

from ttftc.ops.attention import allowed_pairs, attention


def dense_attention(q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0):
    """Repeat K/V per query head, mask with explicit loops over positions: slow, small, plainly right."""
    b, hq, sq, d = q.shape
    group = hq // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    skv = k.shape[2]
    visible = torch.ones(b, 1, sq, skv, dtype=torch.bool)
    for bi in range(b):
        for i in range(sq):
            for j in range(skv):
                pos = q_offset + i
                ok = True
                if causal:
                    ok = j <= pos and (window <= 0 or j > pos - window)
                if kv_len is not None and j >= int(kv_len[bi]):
                    ok = False
                visible[bi, 0, i, j] = ok
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return (probs @ v).to(q.dtype)


CASES = [
    dict(sq=5, skv=5, causal=True),
    dict(sq=5, skv=5, causal=False),
    dict(sq=3, skv=8, causal=True, q_offset=5),
    dict(sq=7, skv=7, causal=True, window=3),
    dict(sq=4, skv=9, causal=True, q_offset=5, window=2),
    dict(sq=6, skv=6, causal=True, kv_len=[6, 3]),
    dict(sq=6, skv=6, causal=False, kv_len=[0, 4]),  # sequence 0 sees no key: zeros
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)])
def test_reference_matches_dense(case, hq, hkv):
    torch.manual_seed(0)
    case = dict(case)
    sq, skv = case.pop("sq"), case.pop("skv")
    kv_len = case.pop("kv_len", None)
    kv_len = torch.tensor(kv_len) if kv_len is not None else None
    b = 2 if kv_len is not None else 1
    q, k, v = torch.randn(b, hq, sq, 8), torch.randn(b, hkv, skv, 8), torch.randn(b, hkv, skv, 8)
    expected = dense_attention(q, k, v, kv_len, scale=0.3, **case)
    actual = attention.reference(q, k, v, kv_len, scale=0.3, **case)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    if kv_len is not None and int(kv_len[0]) == 0:
        assert actual[0].abs().max() == 0


def test_rows_past_a_window_with_no_key_are_zero():
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8)
    out = attention.reference(q, k, v, causal=True, scale=1.0, q_offset=3, window=1)
    # Rows at positions 3..6 with a window of 1 only see key 3..6, beyond the 2 keys.
    assert out.abs().max() == 0


@pytest.mark.parametrize(
    "shapes",
    [
        ((1, 2, 4, 8), (1, 2, 4, 16), (1, 2, 4, 16)),  # q/k head dims differ
        ((1, 3, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)),  # 3 query heads over 2 KV heads
        ((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 5, 8)),  # k/v lengths differ
        ((2, 4, 8), (2, 4, 8), (2, 4, 8)),  # not 4-D
    ],
)
def test_bad_shapes_raise_a_clear_error(shapes):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match="ttftc.attention"):
        attention.overload(q, k, v, causal=True, scale=1.0)


def test_allowed_pairs_counts_the_mask():
    mask = torch.ones(4, 9, dtype=torch.bool)
    for i in range(4):
        for j in range(9):
            pos = 5 + i
            mask[i, j] = j <= pos and j > pos - 3
    assert allowed_pairs(4, 9, causal=True, q_offset=5, window=3) == int(mask.sum())
    assert allowed_pairs(4, 9, causal=False, q_offset=0, window=0) == 36
