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
        super().__init__(config, on_lowered=lambda lowered: self.graphs.append(lowered.graph_module))
        self.graphs = []

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
@pytest.mark.parametrize("dynamic_shapes, graphs", [("auto", 1), ("dynamo", 2)])
def test_symbolic_lengths_still_fuse(dynamic_shapes, graphs):
    """"auto" traces the first call with a symbolic length; "dynamo" recompiles symbolic at the second length."""
    model = zoo.build("llama", "eager")
    backend = RecordingBackend(ATTENTION_ONLY.replace(dynamic_shapes=dynamic_shapes))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for length in (7, 12, 19):
            ids = zoo.example_ids(model, length)
            assert_logits_match(compiled(ids).logits, model(ids).logits)
    assert backend.report().pass_counts["attention"] == 2 * len(backend.graphs)
    assert len(backend.graphs) == graphs


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


def _copies_after_attention(gm) -> list[int]:
    """For each ttftc.attention node: how many copies (clones) its result goes through before a non-view op."""
    layout_ops = {torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.view.default,
                  torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default}
    counts = []
    for node in gm.graph.nodes:
        if node.meta.get("ttftc_op") != "attention" and "ttftc.attention" not in str(node.target):
            continue
        copies, frontier = 0, [node]
        while frontier:
            current = frontier.pop()
            for user in current.users:
                if user.target is torch.ops.aten.clone.default:
                    copies += 1
                    frontier.append(user)
                elif user.target in layout_ops:
                    frontier.append(user)
        counts.append(copies)
    return counts


@needs_transformers
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("batch", [1, 2])
def test_attention_result_reaches_the_output_projection_with_one_copy(family, attn, batch):
    # Eager attention merges heads with transpose → contiguous (one copy); SDPA's CPU kernel returns the
    # [B, S, H, D] layout the graph relies on, which the pass restores with one copy. A batch of one used to
    # look like a permuted layout (its size-1 batch dimension sorted last) and got a second, transposing copy.
    model = zoo.build(family, attn)
    ids = zoo.example_ids(model, 10, batch=batch)
    actual, expected, backend = run(model, ids)
    assert backend.report().pass_counts["attention"] == model.config.num_hidden_layers
    (gm,) = backend.graphs
    assert _copies_after_attention(gm) == [1] * model.config.num_hidden_layers
    assert_logits_match(logits(actual), logits(expected))


@needs_transformers
@pytest.mark.parametrize("family,attn", [("llama", "eager"), ("llama", "sdpa"), ("gpt2", "eager"), ("qwen2", "sdpa")])
@pytest.mark.parametrize("batch", [1, 2])
def test_mask_without_cache_is_proven_from_the_in_graph_positions(family, attn, batch):
    # With use_cache=False and no attention_mask, Hugging Face builds the mask through its packed-sequence
    # detection: ids = cumsum(diff(positions) != 1), visible = ids[q] == ids[k] and positions[k] <= positions[q],
    # read with aten.index. The positions are an arange inside the graph, so the ids are 0 everywhere and the
    # mask is plain causal, for every length and batch.
    model = zoo.build(family, attn)
    ids = zoo.example_ids(model, 9, batch=batch)
    actual, expected, backend = run(lambda x: model(x, use_cache=False), ids)
    report = backend.report()
    assert report.pass_counts["attention"] == model.config.num_hidden_layers, report.rejections
    assert report.rejections["attention"] == []
    assert all(kw["causal"] and kw["q_offset"] == 0 and kw["window"] == 0 for kw in backend.fused())
    assert_logits_match(logits(actual), logits(expected))


@needs_transformers
def test_mask_without_cache_keeps_a_narrow_sliding_window():
    model = zoo.build("mistral", "eager", sliding_window=4)
    actual, expected, backend = run(lambda x: model(x, use_cache=False), zoo.example_ids(model, 13))
    assert [kw["window"] for kw in backend.fused()] == [4, 4]
    assert_logits_match(logits(actual), logits(expected))


@needs_transformers
def test_mask_without_cache_is_proven_at_a_symbolic_length():
    model = zoo.build("llama", "eager")
    backend = RecordingBackend(ATTENTION_ONLY)
    compiled = torch.compile(lambda x: model(x, use_cache=False), backend=backend)
    with torch.no_grad():
        for length in (7, 12):  # the first call already traces a symbolic length; the second reuses it
            ids = zoo.example_ids(model, length)
            assert_logits_match(compiled(ids).logits, model(ids, use_cache=False).logits)
    assert len(backend.graphs) == 1
    assert any("symbolic sizes" in note for note in backend.report().notes)
    assert backend.report().pass_counts["attention"] == 2, backend.report().rejections


@needs_transformers
def test_position_ids_given_at_run_time_are_not_proven():
    # Real packed sequences: the positions restart, so the mask is block-diagonal. They arrive as an input, so
    # the prover cannot know them and the attention stays as the model wrote it.
    model = zoo.build("llama", "eager")
    ids = zoo.example_ids(model, 9)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    actual, expected, backend = run(lambda x, p: model(x, position_ids=p, use_cache=False), ids, positions)
    report = backend.report()
    assert report.pass_counts["attention"] == 0
    assert report.rejections["attention"] and all("runtime input" in r for r in report.rejections["attention"])
    assert_logits_match(logits(actual), logits(expected))


# -- hand-written attention: every mask form and every rejection -------------------------------------------------------


class TinyAttention(nn.Module):
    """One attention block with the masking spelled out, so each test picks the form it needs."""

    def __init__(self, mask="causal", heads=2, kv_heads=2, head_dim=16, dropout=0.0, softcap=None,
                 return_probs=False, prefix=0, merge="transpose", positions="arange"):
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
        self.merge = merge  # "transpose": Hugging Face's head merge; "view": a reader that needs contiguous heads
        self.positions = positions  # how the mask's query/key positions are computed (see _positions)
        # GPT-2's historical causal buffer, and a mask that is not triangular.
        self.register_buffer("bias", torch.tril(torch.ones(64, 64, dtype=torch.bool)).view(1, 1, 64, 64))
        self.register_buffer("noise", torch.rand(64, 64, generator=torch.Generator().manual_seed(3)) > 0.5)

    def _positions(self, n, device):
        ramp = torch.arange(n, device=device)
        if self.positions == "cumsum":  # a ramp written as a prefix sum of ones
            return torch.ones(n, dtype=torch.long, device=device).cumsum(0) - 1
        if self.positions == "index":  # a ramp gathered through itself (aten.index)
            return ramp[torch.arange(n, device=device)]
        if self.positions == "reversed":  # n-1, ..., 0: a gather whose index could be negative for the prover
            return ramp[ramp * -1 + (n - 1)]
        if self.positions == "packed":  # two sequences packed in one row: 0, 1, 2, 0, 1, ...
            return torch.cat([ramp[:3], ramp[: n - 3]])
        return ramp

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
        qi = self._positions(s, x.device)[:, None] + self.prefix
        kj = self._positions(skv, x.device)[None, :]
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
        heads = torch.matmul(probs, v)
        if self.merge == "view":  # [B, H, S*D]: only a view of a contiguous [B, H, S, D] tensor
            return heads.view(b, self.h, s * self.d)
        out = self.o(heads.transpose(1, 2).reshape(b, s, -1))
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
    ("positions from a cumsum of ones", dict(positions="cumsum"), dict(causal=True, q_offset=0, window=0)),
    ("positions gathered with aten.index", dict(positions="index"), dict(causal=True, q_offset=0, window=0)),
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
    ("reversed positions", dict(positions="reversed"), "may be negative"),
    ("packed positions", dict(positions="packed"), "not one ramp"),
]


@pytest.mark.parametrize("name,kwargs,reason", REJECTED, ids=[r[0] for r in REJECTED])
def test_unprovable_matches_are_rejected_with_a_reason(name, kwargs, reason):
    # Traced at a static length, where the prover reaches the step that fails; at a symbolic length some of these
    # masks are refused earlier, for an op the prover does not know (still a rejection, with its reason).
    model = TinyAttention(**kwargs).eval()
    x = torch.randn(1, 9, model.h * model.d)
    actual, eager, backend = run(model, x, config=ATTENTION_ONLY.replace(dynamic_shapes="dynamo"))
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


@pytest.mark.parametrize("batch", [1, 2])
def test_reader_that_relies_on_contiguous_heads_gets_a_contiguous_result(batch):
    # The CPU lowering returns [B, H, S, D] with [B, S, H, D] strides; a `view` traced on the contiguous
    # eager result would fail on it, so the pass hands such readers a contiguous copy.
    model = TinyAttention(merge="view").eval()
    x = torch.randn(batch, 9, model.h * model.d)
    actual, eager, backend = run(model, x)
    assert backend.report().pass_counts["attention"] == 1
    (gm,) = backend.graphs
    assert _copies_after_attention(gm) == [1]
    assert backend.report().providers["attention"] == {"cpu": 1}  # the lowering whose layout differs
    torch.testing.assert_close(actual, eager, atol=1e-5, rtol=1e-5)


@needs_transformers
@pytest.mark.parametrize("use_cache", [True, False])
def test_eager_attention_model_at_4096_tokens_allocates_no_score_matrix(use_cache):
    # Eager attention allocates [B, H, n, n] scores and HF an [1, 1, n, n] float mask (64 MiB each per head at
    # 4096 tokens). Once fused, neither exists: the mask subgraph is proven and removed, the lowering streams.
    length = 4096
    model = zoo.build("llama", "eager", num_hidden_layers=1, max_position_embeddings=length)
    ids = zoo.example_ids(model, length)
    backend = ttftc.backend(ATTENTION_ONLY)
    compiled = torch.compile(lambda x: model(x, use_cache=use_cache), backend=backend)
    with torch.inference_mode():
        compiled(ids)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            compiled(ids)
    assert backend.report().pass_counts["attention"] == 1
    one_head_scores = length * length * 4
    biggest = max(prof.events(), key=lambda e: e.cpu_memory_usage)
    assert biggest.cpu_memory_usage < one_head_scores / 4, (biggest.name, biggest.cpu_memory_usage)
