"""The attention pass: what it fuses in the zoo models, what it proves, and what it refuses (with the reason)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ttftc
from ttftc import zoo
from ttftc.dynamo_backend import TtftcBackend
from tests.helpers import assert_logits_match, needs_transformers, zoo_cases

ATTENTION_ONLY = ttftc.Config(passes=("attention",))


class RecordingBackend(TtftcBackend):
    """A ttftc backend that keeps every compiled aten graph, to read the fused ops' parameters."""

    def __init__(self, config):
        super().__init__(config)
        self.graphs = []

    def _compile_real(self, aten_gm, inputs, num_aot_inputs):
        result = super()._compile_real(aten_gm, inputs, num_aot_inputs)
        self.graphs.append(aten_gm)
        return result

    def fused(self) -> list[dict]:
        return [
            dict(n.kwargs)
            for gm in self.graphs
            for n in gm.graph.nodes
            if n.meta.get("ttftc_provider") is not None or "ttftc.attention" in str(n.target)
        ]


def run(model, *inputs, config=ATTENTION_ONLY):
    backend = RecordingBackend(config)
    with torch.no_grad():
        expected = model(*inputs)
        actual = torch.compile(model, backend=backend)(*inputs)
    return actual, expected, backend


def logits(out):
    if isinstance(out, tuple):
        return out[0]
    return getattr(out, "logits", out)


# -- zoo models ------------------------------------------------------------------------------------------------------


@needs_transformers
@pytest.mark.parametrize("family,attn", zoo_cases(tuple(zoo.FAMILIES)))
def test_zoo_attention_is_fused_in_every_layer(family, attn):
    model = zoo.build(family, attn)
    actual, expected, backend = run(model, zoo.example_ids(model, 11))
    report = backend.report()
    assert report.pass_counts["attention"] == model.config.num_hidden_layers, report.rejections
    assert report.rejections["attention"] == []
    assert all(kw["causal"] and kw["q_offset"] == 0 for kw in backend.fused())
    assert_logits_match(logits(actual), logits(expected))


@needs_transformers
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_mistral_default_window_is_wider_than_the_prompt(attn):
    model = zoo.build("mistral", attn)
    actual, expected, backend = run(model, zoo.example_ids(model, 9))
    # Eager spells the 4096 window out in its mask; SDPA sees it cannot bind and passes is_causal instead.
    window = 4096 if attn == "eager" else 0
    assert [kw["window"] for kw in backend.fused()] == [window, window]
    assert_logits_match(logits(actual), logits(expected))


@needs_transformers
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_mistral_narrow_sliding_window_becomes_the_window_parameter(attn):
    model = zoo.build("mistral", attn, sliding_window=4)
    actual, expected, backend = run(model, zoo.example_ids(model, 13))
    assert backend.report().pass_counts["attention"] == 2
    assert [kw["window"] for kw in backend.fused()] == [4, 4]
    assert_logits_match(logits(actual), logits(expected))


@needs_transformers
def test_dynamic_lengths_after_recompile_still_fuse():
    model = zoo.build("llama", "eager")
    backend = RecordingBackend(ATTENTION_ONLY)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for length in (7, 12):  # the second length makes Dynamo recompile with a symbolic length
            ids = zoo.example_ids(model, length)
            assert_logits_match(compiled(ids).logits, model(ids).logits)
    assert backend.report().pass_counts["attention"] == 2 * len(backend.graphs)
    assert len(backend.graphs) >= 2


@needs_transformers
def test_output_attentions_keeps_the_probabilities_and_is_rejected():
    model = zoo.build("llama", "eager")
    ids = zoo.example_ids(model, 9)
    actual, expected, backend = run(lambda x: model(x, output_attentions=True), ids)
    report = backend.report()
    assert report.pass_counts["attention"] == 0
    assert len(report.rejections["attention"]) == 2
    assert all("other users" in r for r in report.rejections["attention"])
    assert_logits_match(actual.logits, expected.logits)
    for a, e in zip(actual.attentions, expected.attentions):
        torch.testing.assert_close(a, e)


# -- hand-written attention: every mask form and every rejection -------------------------------------------------------


class TinyAttention(nn.Module):
    """One attention block with the masking spelled out, so each test picks the form it needs."""

    def __init__(self, mask="causal", heads=2, kv_heads=2, head_dim=16, dropout=0.0, softcap=None,
                 return_probs=False, prefix=0):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.hkv, self.d = heads, kv_heads, head_dim
        dim = heads * head_dim
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, kv_heads * head_dim)
        self.v = nn.Linear(dim, kv_heads * head_dim)
        self.o = nn.Linear(dim, dim)
        self.mask, self.dropout, self.softcap = mask, dropout, softcap
        self.return_probs, self.prefix = return_probs, prefix
        # GPT-2's historical causal buffer, and a mask that is not triangular.
        self.register_buffer("bias", torch.tril(torch.ones(64, 64, dtype=torch.bool)).view(1, 1, 64, 64))
        self.register_buffer("noise", torch.rand(64, 64, generator=torch.Generator().manual_seed(3)) > 0.5)

    def forward(self, x, pad=None):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).transpose(1, 2)
        # `prefix` extra keys in front of the queries: the causal diagonal moves to q_offset = prefix.
        kx = torch.cat([x[:, :1].expand(b, self.prefix, x.shape[-1]), x], 1) if self.prefix else x
        skv = kx.shape[1]
        k = self.k(kx).view(b, skv, self.hkv, self.d).transpose(1, 2)
        v = self.v(kx).view(b, skv, self.hkv, self.d).transpose(1, 2)
        if self.hkv != self.h:  # repeat_kv, as Hugging Face writes it
            n = self.h // self.hkv
            k = k[:, :, None].expand(b, self.hkv, n, skv, self.d).reshape(b, self.h, skv, self.d)
            v = v[:, :, None].expand(b, self.hkv, n, skv, self.d).reshape(b, self.h, skv, self.d)
        scores = torch.matmul(q, k.transpose(-1, -2)) / (self.d ** 0.5)
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        qi = torch.arange(s, device=x.device)[:, None] + self.prefix
        kj = torch.arange(skv, device=x.device)[None, :]
        neg = torch.finfo(scores.dtype).min
        if self.mask == "causal":
            scores = scores + torch.where(kj <= qi, 0.0, neg)
        elif self.mask == "masked_fill":
            scores = scores.masked_fill(kj > qi, float("-inf"))
        elif self.mask == "triu":
            scores = scores + torch.full((s, s), neg).triu(1)
        elif self.mask == "bias":
            scores = torch.where(self.bias[:, :, :s, :s], scores, neg)
        elif self.mask == "window":
            scores = scores + torch.where((kj <= qi) & (kj > qi - 3), 0.0, neg)
        elif self.mask == "anti_causal":
            scores = scores + torch.where(kj >= qi, 0.0, neg)
        elif self.mask == "strictly_causal":
            scores = scores + torch.where(kj < qi, 0.0, neg)
        elif self.mask == "not_triangular":
            scores = scores.masked_fill(self.noise[:s, :s], neg)
        elif self.mask == "soft":
            scores = scores + torch.where(kj <= qi, 0.0, -1.0)
        elif self.mask == "padding":
            scores = scores + torch.where((kj <= qi) & pad[:, None, None, :].bool(), 0.0, neg)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, self.dropout, self.training)
        out = self.o(torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1))
        return (out, probs) if self.return_probs else out


ACCEPTED = [
    ("arange+where", dict(mask="causal"), dict(causal=True, q_offset=0, window=0)),
    ("masked_fill -inf", dict(mask="masked_fill"), dict(causal=True, q_offset=0, window=0)),
    ("triu of a full matrix", dict(mask="triu"), dict(causal=True, q_offset=0, window=0)),
    ("tril bias buffer", dict(mask="bias"), dict(causal=True, q_offset=0, window=0)),
    ("sliding window", dict(mask="window"), dict(causal=True, q_offset=0, window=3)),
    ("keys before the queries", dict(prefix=3), dict(causal=True, q_offset=3, window=0)),
    ("gqa 4:1 via repeat_kv", dict(heads=4, kv_heads=1), dict(causal=True, q_offset=0, window=0)),
    ("no mask", dict(mask="none"), dict(causal=False, q_offset=0, window=0)),
]


@pytest.mark.parametrize("name,kwargs,expected", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_mask_forms_are_proven(name, kwargs, expected):
    model = TinyAttention(**kwargs).eval()
    x = torch.randn(1, 9, model.h * model.d)
    actual, eager, backend = run(model, x)
    assert backend.report().pass_counts["attention"] == 1, backend.report().rejections
    (fused,) = backend.fused()
    assert {k: fused[k] for k in expected} == expected
    assert fused["scale"] == pytest.approx(model.d ** -0.5)
    assert_logits_match(actual, eager)


REJECTED = [
    ("anti_causal", dict(mask="anti_causal"), "neither causal nor a sliding window"),
    ("strictly_causal", dict(mask="strictly_causal"), "early rows would see no key"),
    ("not_triangular", dict(mask="not_triangular"), "not triangular"),
    ("soft mask", dict(mask="soft"), "neither 0 nor a masking value"),
    ("soft-capping", dict(softcap=30.0), "soft-capping"),
    ("probabilities returned", dict(return_probs=True), "other users"),
]


@pytest.mark.parametrize("name,kwargs,reason", REJECTED, ids=[r[0] for r in REJECTED])
def test_unprovable_matches_are_rejected_with_a_reason(name, kwargs, reason):
    model = TinyAttention(**kwargs).eval()
    x = torch.randn(1, 9, model.h * model.d)
    actual, eager, backend = run(model, x)
    report = backend.report()
    assert report.pass_counts["attention"] == 0
    assert any(reason in r for r in report.rejections["attention"]), report.rejections
    assert "ttftc.attention" not in report.ops_after
    assert_logits_match(logits(actual), logits(eager))


def test_padding_mask_from_an_input_is_rejected():
    model = TinyAttention(mask="padding").eval()
    x = torch.randn(1, 9, model.h * model.d)
    pad = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1]])
    actual, eager, backend = run(model, x, pad)
    assert any("runtime input" in r for r in backend.report().rejections["attention"])
    torch.testing.assert_close(actual, eager, equal_nan=True)


def test_dropout_with_p_above_zero_is_rejected():
    model = TinyAttention(dropout=0.5).train()
    x = torch.randn(1, 9, model.h * model.d)
    report = ttftc.explain(model, x, config=ATTENTION_ONLY)
    assert report.pass_counts["attention"] == 0
    assert any("dropout" in r for r in report.rejections["attention"])


def test_explain_names_the_rejection():
    model = TinyAttention(softcap=30.0).eval()
    report = ttftc.explain(model, torch.randn(1, 5, model.h * model.d), config=ATTENTION_ONLY)
    assert "soft-capping" in str(report)
