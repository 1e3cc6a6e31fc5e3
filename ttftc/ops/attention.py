"""ttftc.attention: exact softmax attention, the contract between the attention pass and its lowerings.

Layout is SDPA's: q [B, Hq, Sq, D], k and v [B, Hkv, Skv, D] with Hq a multiple of Hkv. Query head h reads
key/value head h // (Hq // Hkv) (GQA by index mapping, never by repeating K and V).

Query row i sits at absolute position q_offset + i. With `causal`, it sees keys j <= q_offset + i (bottom-right
alignment when q_offset == Skv - Sq, as in chunked prefill and prefix reuse). With `window` > 0 it also only sees
keys j > q_offset + i - window (sliding-window attention). `kv_len[b]`, when given, masks keys j >= kv_len[b] of
sequence b (right-padded buckets). A row that sees no key at all returns zeros.
"""

from __future__ import annotations

import torch

from ttftc.ops.registry import define_op

# Rows per reference step: bounds the reference's score tensor to B*Hq*_REF_ROWS*Skv instead of Sq*Skv.
_REF_ROWS = 1024


def allowed_pairs(q_len: int, kv_len: int, *, causal: bool, q_offset: int, window: int) -> int:
    """How many (query, key) pairs the mask lets through, for one head of one sequence."""
    if not causal:
        return q_len * kv_len
    total = 0
    # Closed form would do, but Sq is at most a few thousand and this stays obviously right.
    for i in range(q_len):
        hi = min(kv_len, q_offset + i + 1)
        lo = max(0, q_offset + i + 1 - window) if window > 0 else 0
        total += max(0, hi - lo)
    return total


def _flops(q, k, v, *, causal, scale, q_offset=0, window=0, kv_len=None) -> int:
    b, hq, sq, d = q.shape
    pairs = allowed_pairs(int(sq), int(k.shape[2]), causal=causal, q_offset=int(q_offset), window=window)
    return 4 * int(b) * int(hq) * pairs * int(d)


def attention_mask(
    q_len: int,
    kv_len_max: int,
    *,
    causal: bool,
    q_offset: int,
    window: int,
    kv_len: torch.Tensor | None,
    device: torch.device,
    row_start: int = 0,
) -> torch.Tensor | None:
    """Boolean mask [B or 1, 1, rows, Skv], True where a key is visible; None when everything is visible."""
    if not causal and window <= 0 and kv_len is None:
        return None
    rows = torch.arange(row_start, row_start + q_len, device=device)[:, None] + q_offset
    cols = torch.arange(kv_len_max, device=device)[None, :]
    visible = torch.ones(q_len, kv_len_max, dtype=torch.bool, device=device)
    if causal:
        visible &= cols <= rows
        if window > 0:
            visible &= cols > rows - window
    visible = visible[None, None]
    if kv_len is not None:
        visible = visible & (cols[None, None] < kv_len.to(device).view(-1, 1, 1, 1))
    return visible


def _check(q, k, v) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ttftc.attention wants 4-D [B, H, S, D] tensors, got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[-1] != k.shape[-1] or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"ttftc.attention: incompatible q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"ttftc.attention: {q.shape[1]} query heads is not a multiple of {k.shape[1]} KV heads")


def _fake(q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0):
    _check(q, k, v)
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


@define_op("attention", fake=_fake, flops=_flops)
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None = None,
    *,
    causal: bool,
    scale: float,
    q_offset: int = 0,
    window: int = 0,
) -> torch.Tensor:
    _check(q, k, v)
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    group = hq // hkv
    # [B, Hkv, G, S, D] against [B, Hkv, 1, S, D]: the group axis broadcasts, so K and V are never repeated.
    qg = q.reshape(b, hkv, group, sq, d).float()
    kf = k.float().unsqueeze(2)
    vf = v.float().unsqueeze(2)
    out = torch.empty(b, hkv, group, sq, v.shape[-1], dtype=torch.float32, device=q.device)
    for start in range(0, sq, _REF_ROWS):
        stop = min(sq, start + _REF_ROWS)
        scores = torch.matmul(qg[:, :, :, start:stop], kf.transpose(-1, -2)) * scale
        visible = attention_mask(
            stop - start, skv, causal=causal, q_offset=q_offset, window=window, kv_len=kv_len,
            device=q.device, row_start=start,
        )
        if visible is not None:
            visible = visible.unsqueeze(2)  # broadcast over the group axis
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if visible is not None:
            # A fully masked row softmaxes to NaN; the contract says zeros.
            probs = torch.nan_to_num(probs, nan=0.0)
        out[:, :, :, start:stop] = torch.matmul(probs, vf)
    return out.reshape(b, hq, sq, v.shape[-1]).to(q.dtype)
