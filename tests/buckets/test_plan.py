"""The bucketing plan proves padding safe on causal models and refuses, with a reason, everything else."""

import pytest
import torch
import torch.nn.functional as F

import ttftc
from tests.helpers import needs_transformers
from ttftc import zoo
from ttftc.buckets.capture import analyse_padding
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


def _plan(mix):
    return analyse_padding(_Toy(mix).eval(), BUCKETS, CPU)


@pytest.mark.parametrize(
    "mix, evidence",
    [
        (_causal_sdpa, "SDPA with is_causal=True"),
        (lambda x: _masked_softmax(x, causal=True), "softmax over causally masked scores"),
        (lambda x: F.layer_norm(x, (16,)), None),  # a norm over the hidden axis is per token
        (lambda x: torch.cumsum(x, dim=1), None),  # a prefix sum reads only earlier positions
    ],
    ids=["causal-sdpa", "causal-mask", "hidden-norm", "prefix-sum"],
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
    ],
    ids=["bidirectional", "anti-causal-mask", "sequence-mean", "sequence-norm", "last-position", "pooling",
         "data-dependent-sdpa-mask", "data-dependent-softmax-mask", "index", "gather", "index-select", "cat",
         "embedding-by-position"],
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
