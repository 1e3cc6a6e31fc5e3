"""The bucketing plan proves padding safe on causal models and refuses, with a reason, everything else."""

import pytest
import torch
import torch.nn.functional as F

import ttftc
from tests.helpers import needs_transformers
from ttftc import zoo
from ttftc.buckets.capture import analyse_padding
from ttftc.buckets.plan import BucketPlan, plan_from_graph, refused
from ttftc.buckets.table import DEFAULT_BUCKETS, bucket_for, effective_buckets

CPU = torch.device("cpu")
BUCKETS = (16, 32)


class _Toy(torch.nn.Module):
    """token ids -> embeddings -> `mix` (the op under test) -> a per-token head."""

    def __init__(self, mix):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 32)
        self.mix = mix

    def forward(self, input_ids, position_ids=None):
        return self.head(self.mix(self.embed(input_ids)))


def _heads(x):
    return x.view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2)


def _merge(x):
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], 16)


def _causal_sdpa(x):
    q = _heads(x)
    return _merge(F.scaled_dot_product_attention(q, q, q, is_causal=True))


def _bidirectional_sdpa(x):
    q = _heads(x)
    return _merge(F.scaled_dot_product_attention(q, q, q))


def _masked_softmax(x, *, causal: bool):
    q = _heads(x)
    n = x.shape[1]
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    hidden = cols > rows if causal else cols < rows  # the wrong way round hides earlier keys instead
    scores = (q @ q.transpose(-1, -2)).masked_fill(hidden, float("-inf"))
    return _merge(torch.softmax(scores, dim=-1) @ q)


def _data_dependent_mask_sdpa(x):
    # Hides the keys whose embedding sums below zero: which ones depends on the tokens, not on positions.
    q = _heads(x)
    visible = (x.sum(-1) > 0)[:, None, None, :]
    return _merge(F.scaled_dot_product_attention(q, q, q, attn_mask=visible))


def _data_dependent_mask_softmax(x):
    q = _heads(x)
    hidden = (x.sum(-1) < 0)[:, None, None, :]
    scores = (q @ q.transpose(-1, -2)).masked_fill(hidden, float("-inf"))
    return _merge(torch.softmax(scores, dim=-1) @ q)


def _reversed(n):
    return torch.arange(n - 1, -1, -1)


def _reversed_positions(x):
    return x[:, _reversed(x.shape[1])]


def _causal_visible(n):
    return torch.arange(n)[None, :] <= torch.arange(n)[:, None]


def _sdpa_with(mask_of_length):
    def mix(x):
        q = _heads(x)
        return _merge(F.scaled_dot_product_attention(q, q, q, attn_mask=mask_of_length(x.shape[1])))
    return mix


def _eager_attention(x, *, scores_to_probs, probs_path=lambda p: p):
    """q·kᵀ → (masking) → probabilities → (dropout, views) → ·V, written out as models write eager attention."""
    q = _heads(x)
    probs = scores_to_probs(q @ q.transpose(-1, -2), x.shape[1])
    return _merge(probs_path(probs) @ q)


def _softmax_where(scores, n):
    return torch.softmax(torch.where(_causal_visible(n), scores, float("-inf")), dim=-1)


def _softmax_where_hidden_first(scores, n):
    return torch.softmax(torch.where(~_causal_visible(n), torch.tensor(float("-inf")), scores), dim=-1)


def _softmax_additive(scores, n):
    additive = torch.zeros(n, n).masked_fill(~_causal_visible(n), torch.finfo(torch.float32).min)
    return torch.softmax(scores / 4.0 + additive, dim=-1)


def _softmax_scaled_after_mask(scores, n):
    return torch.softmax(scores.masked_fill(~_causal_visible(n), float("-inf")).float() * 0.25, dim=-1)


def _plan(mix):
    return analyse_padding(_Toy(mix).eval(), BUCKETS, CPU)


@pytest.mark.parametrize(
    "mix, evidence",
    [
        (_causal_sdpa, "SDPA with is_causal=True"),
        (lambda x: _masked_softmax(x, causal=True), "softmax over causally masked scores"),
        (lambda x: F.layer_norm(x, (16,)), None),  # a norm over the hidden axis is per token
        (lambda x: torch.cumsum(x, dim=1), None),  # a prefix sum reads only earlier positions
        (_sdpa_with(_causal_visible), "SDPA with a causal mask (evaluated)"),
        (_sdpa_with(lambda n: torch.zeros(n, n).masked_fill(~_causal_visible(n), float("-inf"))),
         "SDPA with a causal mask"),
        (lambda x: _eager_attention(x, scores_to_probs=_softmax_where), "probabilities @ V over causal probabilities"),
        (lambda x: _eager_attention(x, scores_to_probs=_softmax_where_hidden_first), "softmax over causally masked"),
        (lambda x: _eager_attention(x, scores_to_probs=_softmax_additive), "softmax over causally masked"),
        (lambda x: _eager_attention(x, scores_to_probs=_softmax_scaled_after_mask), "softmax over causally masked"),
        (lambda x: _eager_attention(x, scores_to_probs=_softmax_where,
                                    probs_path=lambda p: F.dropout(p.transpose(-1, -2), 0.0).transpose(-1, -2)),
         "probabilities @ V"),
        (lambda x: x - x.mean(-1, keepdim=True) + x.amax(dim=(0, 2), keepdim=True), None),  # hidden/batch axes only
        (lambda x: torch.softmax(x, dim=-1), None),  # over the hidden axis
        (lambda x: torch.cat(x.split(8, dim=-1)[::-1], dim=-1), None),  # split and cat along the hidden axis
        (lambda x: torch.cat([x.new_zeros(x.shape[0], 0, 16), x], dim=1), None),  # an empty piece adds no positions
        (lambda x: x[:, 0:] + x[:, -4096:], None),  # slices that keep every position up to the largest bucket
        (lambda x: x[:, :, 0:8].repeat(1, 1, 2), None),  # a hidden-axis slice
        (lambda x: x.index_select(2, torch.arange(15, -1, -1)), None),  # picks along the hidden axis
        (lambda x: F.scaled_dot_product_attention(_heads(x), torch.ones(x.shape[0], 2, 3, 8),
                                                  torch.ones(x.shape[0], 2, 3, 8)).transpose(1, 2).reshape(
            x.shape[0], x.shape[1], 16), None),  # attends to a fixed-length memory
    ],
    ids=["causal-sdpa", "causal-mask", "hidden-norm", "prefix-sum", "sdpa-bool-mask", "sdpa-additive-mask",
         "eager-where", "eager-where-hidden-first", "eager-additive", "eager-scaled-after-mask", "eager-dropout-views",
         "hidden-reductions", "hidden-softmax", "hidden-split-cat", "empty-cat", "full-slices", "hidden-slice",
         "hidden-index-select", "fixed-memory"],
)
def test_padding_proven_safe(mix, evidence):
    plan = _plan(mix)
    assert plan.safe, plan.reason
    assert plan.buckets == BUCKETS
    if evidence:
        assert any(evidence in e for e in plan.evidence), plan.evidence


@pytest.mark.parametrize(
    "mix, reason",
    [
        (_bidirectional_sdpa, "bidirectional attention"),
        (lambda x: _masked_softmax(x, causal=False), "lets a query see later keys"),
        (lambda x: x - x.mean(dim=1, keepdim=True), "reduces across the sequence axis"),
        (lambda x: F.layer_norm(x.transpose(1, 2), (x.shape[1],)).transpose(1, 2), "normalises across the sequence"),
        (lambda x: x[:, -1:], "slices the sequence axis"),
        (lambda x: F.avg_pool1d(x.transpose(1, 2), 2, 1, padding=1).transpose(1, 2), "cannot prove"),
        (_data_dependent_mask_sdpa, "depends on graph inputs"),
        (_data_dependent_mask_softmax, "depends on graph inputs"),
        (_reversed_positions, "picks positions along the sequence axis"),
        (lambda x: torch.gather(x, 1, torch.zeros_like(x, dtype=torch.long)), "picks positions along the sequence"),
        (lambda x: x.index_select(1, _reversed(x.shape[1])), "picks positions along the sequence axis"),
        (lambda x: torch.cat([x, 2 * x], dim=1)[:, : x.shape[1]], "concatenates along the sequence axis"),
        (lambda x: F.embedding(_reversed(x.shape[1]), x[0])[None], "embedding table indexed by position"),
        (_sdpa_with(lambda n: torch.ones(n, n, dtype=torch.bool).triu()), "lets a query see later keys"),
        (_sdpa_with(lambda n: torch.ones(n, 1, dtype=torch.bool)), "is not a [query, key] mask"),
        (lambda x: _merge(F.scaled_dot_product_attention(_heads(x), _heads(x), _heads(x), is_causal=True,
                                                         attn_mask=_causal_visible(x.shape[1]))),
         "is_causal together with a mask is not analysed"),
        (lambda x: _eager_attention(x, scores_to_probs=lambda s, n: torch.softmax(s, dim=-1)),
         "softmax over the sequence axis without a proven causal mask (no causal mask is applied"),
        (lambda x: _eager_attention(x, scores_to_probs=lambda s, n: torch.softmax(
            s.masked_fill(~_causal_visible(n), -1.0), dim=-1)), "softmax over the sequence axis without a proven"),
        (lambda x: _eager_attention(x, scores_to_probs=lambda s, n: torch.softmax(
            (s + torch.zeros(n, n).masked_fill(~_causal_visible(n), float("-inf")))
            / (1 + x.abs().sum(-1))[:, None, :, None], dim=-1)),
         "softmax over the sequence axis without a proven causal mask (no causal mask is applied"),
        (lambda x: x.transpose(1, 2) @ x @ torch.ones(16, 16), "sums over the sequence axis outside a causal"),
        (lambda x: x - x.sum(), "reduces across the sequence axis"),
        (lambda x: x - x.sum(dim=-2, keepdim=True), "reduces across the sequence axis"),
        (lambda x: x - x.amax(dim=(1, 2), keepdim=True), "reduces across the sequence axis"),
        (lambda x: x[:, 1:], "slices the sequence axis"),
        (lambda x: x[:, ::2].repeat(1, 2, 1), "slices the sequence axis"),
        (lambda x: x * x.select(1, 0)[:, None], "picks positions along the sequence axis"),
    ],
    ids=["bidirectional", "anti-causal-mask", "sequence-mean", "sequence-norm", "last-position", "pooling",
         "data-dependent-sdpa-mask", "data-dependent-softmax-mask", "index", "gather", "index-select", "cat",
         "embedding-by-position", "sdpa-upper-mask", "sdpa-1d-mask", "causal-and-mask", "unmasked-softmax",
         "mask-fill-not-hidden", "scores-scaled-by-data", "sequence-matmul", "full-sum", "sequence-sum",
         "sequence-amax", "shifted-slice", "strided-slice", "first-position"],
)
def test_padding_refused_with_reason(mix, reason):
    plan = _plan(mix)
    assert not plan.safe
    assert reason in plan.reason
    assert "refused" in plan.describe() and reason in plan.describe()


@needs_transformers
def test_bert_encoder_is_refused_and_explain_says_why():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=64)).eval()
    plan = analyse_padding(bert, BUCKETS, CPU)
    assert not plan.safe
    assert "bidirectional attention" in plan.reason
    ids = torch.randint(0, 64, (1, 9))
    report = ttftc.explain(bert, ids, config=ttftc.Config(buckets=BUCKETS))
    assert any("refused" in n and "bidirectional" in n for n in report.notes), report.notes


@needs_transformers
def test_sliding_window_cache_shorter_than_a_bucket_is_refused():
    # Mistral's cache keeps the last window-1 keys: with a 24-token window a 32-token bucket would keep
    # padded keys, so the plan must not allow it. (Buckets within the window are proven safe: the zoo's
    # mistral, window 4096, in tests/runtime/test_bucketed.py.)
    model = zoo.build("mistral", "sdpa", sliding_window=24)
    refused = analyse_padding(model, (16, 32), CPU)
    assert not refused.safe and "slices the sequence axis" in refused.reason


def test_bucket_table():
    assert DEFAULT_BUCKETS == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    assert effective_buckets(None, 512) == (16, 32, 64, 128, 256, 512)
    assert effective_buckets((100, 300, 700), 512) == (100, 300, 512)
    assert effective_buckets((8, 64), None) == (8, 64)
    assert bucket_for(1, (16, 32)) == 16 and bucket_for(16, (16, 32)) == 16 and bucket_for(17, (16, 32)) == 32
    assert bucket_for(33, (16, 32)) is None
    with pytest.raises(ValueError):
        bucket_for(0, (16,))


def test_a_plan_describes_itself_and_round_trips_through_a_dict():
    plan = _plan(lambda x: _eager_attention(x, scores_to_probs=_softmax_where) + _causal_sdpa(x))
    assert plan.safe and plan.reason is None
    assert plan.evidence == ("1x softmax over causally masked scores (evaluated)",
                             "1x probabilities @ V over causal probabilities", "1x SDPA with is_causal=True")
    text = plan.describe()
    assert text.startswith("bucketing: padding proven safe; buckets [16, 32] (1x softmax")
    assert BucketPlan.from_dict(plan.to_dict()) == plan
    noted = BucketPlan(True, (16,), notes=("capped",))
    assert noted.describe() == "bucketing: padding proven safe; buckets [16] (no op mixes sequence positions); capped"
    assert BucketPlan.from_dict({"safe": 1, "buckets": ["8"]}) == BucketPlan(True, (8,))
    refusal = refused((16,), "because", notes=("n",))
    assert refusal.describe() == "bucketing: refused, the graph stays dynamic: because; n"
    assert refusal.to_dict() == {"safe": False, "buckets": [16], "reason": "because", "evidence": [], "notes": ["n"]}


def test_the_attention_problem_is_named_first_and_the_rest_counted():
    plan = _plan(lambda x: _bidirectional_sdpa(x - x.mean(dim=1, keepdim=True))[:, 1:])
    assert not plan.safe
    assert plan.reason.endswith("(+2 more)") and "bidirectional attention" in plan.reason.split("(+")[0]


def test_evidence_counts_each_proof():
    plan = _plan(lambda x: _causal_sdpa(_causal_sdpa(x)))
    assert plan.evidence == ("2x SDPA with is_causal=True",)


def test_a_graph_without_a_sequence_symbol_is_refused():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    plan = plan_from_graph(gm, set(), (16,))
    assert not plan.safe and "sequence length was specialised" in plan.reason
