"""ttftc.attention on Ascend NPUs through torch_npu.npu_fusion_attention (BNSD layout).

UNTESTED ON HARDWARE: written from the torch_npu documentation and tested only against the recording stand-in
in tests/npu_standin.py, which checks the arguments the way the documentation states them.

Argument mapping:
- layout "BNSD": q [B, N, Sq, D] and k/v [B, Nkv, Skv, D] are passed as they are; head_num = N (query heads);
  the op does GQA itself when N is a multiple of Nkv.
- non-causal, no kv_len: sparse_mode 0 without a mask.
- causal, no binding window, no kv_len, q_offset == 0 or q_offset == Skv - Sq: sparse_mode 2 (causal aligned
  top-left) or 3 (bottom-right), which take the compressed 2048 x 2048 upper-triangular mask.
- anything else (another q_offset, a binding sliding window, per-sequence kv_len): sparse_mode 0 with an explicit
  boolean mask in the op's convention, True = masked, shaped [1 or B, 1, Sq, Skv]; inner_precise=2 turns on the
  op's handling of rows that see no key, and those rows are zeroed afterwards as the contract says.
"""

from __future__ import annotations

from typing import Optional

import torch

from ttftc.codegen.registry import register_lowering
from ttftc.codegen.npu import _torch_npu
from ttftc.ops.attention import attention_mask

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 512
# npu_fusion_attention's "no limit" for pre/next tokens.
_NO_LIMIT = 2147483647
_COMPRESSED_MASK_SIZE = 2048
SPARSE_DEFAULT, SPARSE_CAUSAL_TOP_LEFT, SPARSE_CAUSAL_BOTTOM_RIGHT = 0, 2, 3


def _unsupported_reason(ctx, q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0) -> Optional[str]:
    reason = _torch_npu.unsupported_device_reason(ctx)
    if reason is not None:
        return reason
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v are not 4-D"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} are not one of fp16/bf16/fp32"
    if k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return "q, k and v head dims differ"
    if not 0 < q.shape[-1] <= MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} is outside 1..{MAX_HEAD_DIM}"
    if q.shape[1] % k.shape[1] != 0:
        return "query heads are not a multiple of KV heads"
    if kv_len is not None and (kv_len.dtype.is_floating_point or kv_len.dim() != 1):
        return "kv_len is not a 1-D integer tensor"
    if q_offset < 0 or window < 0:
        return "negative q_offset or window"
    return None


def _compressed_causal_mask(device) -> torch.Tensor:
    return torch.triu(torch.ones(_COMPRESSED_MASK_SIZE, _COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device), 1)


@register_lowering("attention", "npu", unsupported_reason=_unsupported_reason, priority=20)
def attention_npu(q, k, v, kv_len=None, *, causal, scale, q_offset=0, window=0):
    torch_npu = _torch_npu.load()
    sq, skv = q.shape[2], k.shape[2]
    window_binds = causal and 0 < window < q_offset + sq
    call = dict(head_num=q.shape[1], input_layout="BNSD", scale=float(scale), keep_prob=1.0,
                pre_tockens=_NO_LIMIT, next_tockens=_NO_LIMIT)
    if kv_len is None and not causal:
        return torch_npu.npu_fusion_attention(q, k, v, sparse_mode=SPARSE_DEFAULT, **call)[0]
    if kv_len is None and not window_binds and (q_offset == 0 or q_offset == skv - sq):
        mode = SPARSE_CAUSAL_TOP_LEFT if q_offset == 0 else SPARSE_CAUSAL_BOTTOM_RIGHT
        mask = _compressed_causal_mask(q.device)
        return torch_npu.npu_fusion_attention(q, k, v, atten_mask=mask, sparse_mode=mode, **call)[0]
    visible = attention_mask(sq, skv, causal=causal, q_offset=q_offset, window=window, kv_len=kv_len, device=q.device)
    out = torch_npu.npu_fusion_attention(
        q, k, v, atten_mask=~visible, sparse_mode=SPARSE_DEFAULT, inner_precise=2, **call
    )[0]
    sees_a_key = visible.any(-1, keepdim=True)  # [1 or B, 1, Sq, 1]
    return out.masked_fill(~sees_a_key, 0.0)
