"""The NPU lowering (torch_npu.npu_fusion_attention), against the recording stand-in: arguments and numbers."""

from __future__ import annotations

import pytest
import torch

import ttftc
from ttftc import zoo
from ttftc.codegen.registry import LoweringContext
from ttftc.codegen.npu.attention import _unsupported_reason, attention_npu
from ttftc.ops.attention import attention
from tests.helpers import assert_logits_match, compile_and_run, needs_transformers
from tests.npu_standin import MAX_TOKENS, StandinArgumentError, npu_standin  # noqa: F401  (fixture)

NPU = LoweringContext(device_type="npu", forced_provider=None)


def _run(standin, b, hq, hkv, sq, skv, d=16, *, causal, q_offset=0, window=0, kv_len=None):
    gen = torch.Generator().manual_seed(sq + skv)
    q = torch.randn(b, hq, sq, d, generator=gen)
    k, v = torch.randn(b, hkv, skv, d, generator=gen), torch.randn(b, hkv, skv, d, generator=gen)
    params = dict(causal=causal, scale=d ** -0.5, q_offset=q_offset, window=window)
    out = attention_npu(q, k, v, kv_len, **params)
    torch.testing.assert_close(out, attention.reference(q, k, v, kv_len, **params), atol=1e-5, rtol=1e-5)
    return standin.last("npu_fusion_attention")


def test_layout_heads_and_scale(npu_standin):
    call = _run(npu_standin, 2, 8, 2, 9, 9, causal=False)
    assert call.kwargs["input_layout"] == "BNSD"
    assert call.kwargs["head_num"] == 8
    assert call.shapes["query"] == (2, 8, 9, 16) and call.shapes["key"] == (2, 2, 9, 16)  # GQA: K/V not repeated
    assert call.kwargs["scale"] == pytest.approx(0.25)
    assert call.kwargs["sparse_mode"] == 0 and call.shapes["atten_mask"] is None
    assert call.kwargs["keep_prob"] == 1.0


@pytest.mark.parametrize("sq,skv,q_offset,mode", [(9, 9, 0, 2), (5, 12, 0, 2), (5, 12, 7, 3)])
def test_causal_uses_the_compressed_mask_sparse_modes(npu_standin, sq, skv, q_offset, mode):
    call = _run(npu_standin, 1, 4, 4, sq, skv, causal=True, q_offset=q_offset)
    assert call.kwargs["sparse_mode"] == mode
    assert call.shapes["atten_mask"] == (2048, 2048) and call.dtypes["atten_mask"] == torch.bool
    assert call.kwargs["pre_tockens"] == MAX_TOKENS and call.kwargs["next_tockens"] == MAX_TOKENS


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(sq=6, skv=20, q_offset=3),  # neither top-left nor bottom-right
        dict(sq=12, skv=12, window=4),  # a window that binds
        dict(sq=12, skv=12, kv_len=torch.tensor([12, 5, 0])),  # padded bucket, one empty sequence
    ],
)
def test_other_masks_are_explicit_with_one_meaning_masked(npu_standin, kwargs):
    kv_len = kwargs.pop("kv_len", None)
    b = 3 if kv_len is not None else 1
    sq, skv = kwargs.pop("sq"), kwargs.pop("skv")
    call = _run(npu_standin, b, 2, 1, sq, skv, causal=True, kv_len=kv_len, **kwargs)
    assert call.kwargs["sparse_mode"] == 0 and call.kwargs["inner_precise"] == 2
    mask = call.tensors["atten_mask"]
    assert mask.dtype == torch.bool and mask.shape == (b, 1, sq, skv)
    # The numbers match the reference (checked in _run), and the convention is visible directly: the first query
    # must not see the last key, so that entry is True (masked).
    assert bool(mask[0, 0, 0, -1]) and not bool(mask[0, 0, 0, 0])


def test_standin_rejects_what_the_real_op_rejects(npu_standin):
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(StandinArgumentError, match="multiple"):
        npu_standin.npu_fusion_attention(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), 4, "BNSD")
    with pytest.raises(StandinArgumentError, match="head_num"):
        npu_standin.npu_fusion_attention(q, q, q, 2, "BNSD")
    with pytest.raises(StandinArgumentError, match="2048"):
        square = torch.ones(8, 8, dtype=torch.bool)
        npu_standin.npu_fusion_attention(q, q, q, 4, "BNSD", atten_mask=square, sparse_mode=3)
    with pytest.raises(StandinArgumentError, match="input_layout"):
        npu_standin.npu_fusion_attention(q, q, q, 4, "BHSD")


def test_capability(npu_standin):
    q = torch.empty(1, 2, 8, 16, device="meta")
    ok = dict(causal=True, scale=0.25)
    assert _unsupported_reason(NPU, q, q, q, **ok) is None
    assert "dtypes" in _unsupported_reason(NPU, q, q.half(), q, **ok)
    assert "head dims" in _unsupported_reason(NPU, q, q, torch.empty(1, 2, 8, 32, device="meta"), **ok)
    big = torch.empty(1, 2, 8, 1024, device="meta")
    assert "head dim" in _unsupported_reason(NPU, big, big, big, **ok)
    # CPU tensors only when provider="npu" is forced and the module is the stand-in.
    assert _unsupported_reason(LoweringContext("cpu", None), q, q, q, **ok) is not None
    assert _unsupported_reason(LoweringContext("cpu", "npu"), q, q, q, **ok) is None


def test_without_torch_npu_the_lowering_is_not_capable(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ImportError
    q = torch.empty(1, 2, 8, 16, device="meta")
    assert "not importable" in _unsupported_reason(NPU, q, q, q, causal=True, scale=0.25)


@needs_transformers
@pytest.mark.parametrize("family,attn", [("qwen2", "eager"), ("mistral", "sdpa")])
def test_whole_zoo_model_through_the_standin(npu_standin, family, attn):
    model = zoo.build(family, attn)
    ids = zoo.example_ids(model, 9)
    actual, expected, report = compile_and_run(model, ids, ttftc.Config(passes=("attention",), provider="npu"))
    layers = model.config.num_hidden_layers
    assert report.providers["attention"] == {"npu": layers}
    assert npu_standin.ops() == ["npu_fusion_attention"] * layers
    heads = model.config.num_attention_heads
    assert all(c.kwargs["head_num"] == heads and c.kwargs["sparse_mode"] == 2 for c in npu_standin.calls)
    assert_logits_match(actual, expected)
