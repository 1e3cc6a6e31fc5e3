"""The bucketing plan proves padding safe on causal models and refuses, with a reason, everything else."""

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import ttftc
from tests.helpers import needs_transformers
from ttftc import zoo
from ttftc.buckets.capture import PrefillAdapter, analyse_padding, example_inputs
from ttftc.buckets.plan import BucketPlan, PaddingAnalysis, plan_from_graph, refused
import ttftc.buckets.capture as capture_module
import ttftc.buckets.plan as plan_module
from ttftc.buckets.program import GraphSignature
from ttftc.buckets.table import DEFAULT_BUCKETS, bucket_for, effective_buckets

CPU = torch.device("cpu")
aten = torch.ops.aten
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


def _window_visible(n):
    """A sliding window on its own: hides the keys more than 2 back, but not the later ones (so not causal)."""
    return torch.arange(n)[None, :] > torch.arange(n)[:, None] - 3


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


def _ttftc_attention(x, *, causal: bool):
    q = _heads(x)
    return _merge(torch.ops.ttftc.attention(q, q, q, causal=causal, scale=0.25))


def _softmax_where_filled(fill):
    """Eager attention whose hidden scores are `fill(n)` (a value computed in the graph) instead of -inf."""
    return lambda x: _eager_attention(
        x, scores_to_probs=lambda s, n: torch.softmax(torch.where(_causal_visible(n), s, fill(n)), dim=-1))


def _softmax_of(scores_of):
    """Eager attention over `scores_of(scores, n)`."""
    return lambda x: _eager_attention(x, scores_to_probs=lambda s, n: torch.softmax(scores_of(s, n), dim=-1))


# -1e30 is the threshold itself: a key filled with it is hidden (float64 so that the value is exactly -1e30).
_AT_THRESHOLD = -1e30


def _plan(mix):
    return analyse_padding(_Toy(mix).eval(), BUCKETS, CPU)


@pytest.mark.parametrize(
    "mix, evidence",
    [
        (_causal_sdpa, "SDPA with is_causal=True"),
        (lambda x: _masked_softmax(x, causal=True), "softmax over causally masked scores"),
        (lambda x: F.layer_norm(x, (16,)), None),  # a norm over the hidden axis is per token
        (lambda x: torch.cumsum(x, dim=1), None),  # a prefix sum reads only earlier positions
        (_sdpa_with(_causal_visible), "SDPA with a causal mask (proven)"),
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
        (lambda x: x.narrow(1, 0, x.shape[1]), None),  # ends at the traced length, a node whose value is the size
        (lambda x: x[:, :, 0:8].repeat(1, 1, 2), None),  # a hidden-axis slice
        (lambda x: x.index_select(2, torch.arange(15, -1, -1)), None),  # picks along the hidden axis
        (lambda x: sum(x.unbind())[None], None),  # unbind along its default dim 0, the batch axis
        (lambda x: torch.sort(x)[0], None),  # sort along its default dim -1, the hidden axis
        (lambda x: x.topk(2)[0].sum(-1, keepdim=True) + x, None),  # topk along its default dim -1
        (lambda x: F.scaled_dot_product_attention(_heads(x), torch.ones(x.shape[0], 2, 3, 8),
                                                  torch.ones(x.shape[0], 2, 3, 8)).transpose(1, 2).reshape(
            x.shape[0], x.shape[1], 16), None),  # attends to a fixed-length memory
        (lambda x: _ttftc_attention(x, causal=True), "1x ttftc.attention(causal=True)"),
        (_sdpa_with(lambda n: torch.zeros(n, n).masked_fill(~_causal_visible(n), _AT_THRESHOLD)),
         "SDPA with a causal mask"),
        (_softmax_of(lambda s, n: s.masked_fill(~_causal_visible(n), _AT_THRESHOLD)), "softmax over causally masked"),
        (_softmax_where_filled(lambda n: torch.tensor(_AT_THRESHOLD, dtype=torch.float64)),
         "softmax over causally masked"),
        # a fill that is one masking value everywhere, whatever its shape
        (_softmax_where_filled(lambda n: torch.full((n, n), float("-inf"))), "softmax over causally masked"),
        # a causal mask, then a bias that hides nothing (a relative-position bias, say)
        (_softmax_of(lambda s, n: s.masked_fill(~_causal_visible(n), float("-inf")) + torch.zeros(n, n)),
         "softmax over causally masked"),
        (_softmax_of(lambda s, n: torch.zeros(n, n).masked_fill(~_causal_visible(n), float("-inf")) + s),
         "softmax over causally masked"),  # the mask as the first operand
        # a [batch, head, query, key] mask, as HF builds them: the query x key test reads the last two axes
        (_sdpa_with(lambda n: _causal_visible(n)[None, None]), "1x SDPA with a causal mask (proven)"),
        # a mask whose subgraph reaches one node twice (here the causal mask itself, by two paths)
        (_sdpa_with(lambda n: (lambda v: v & (v | v))(_causal_visible(n))), "SDPA with a causal mask"),
        # a sliding window applied over the causal mask: not causal on its own, so the walk goes on to the
        # causal mask under it (once for each way a mask is applied)
        (_softmax_of(lambda s, n: torch.where(_window_visible(n), s.masked_fill(~_causal_visible(n), float("-inf")),
                                              float("-inf"))), "softmax over causally masked"),
        (_softmax_of(lambda s, n: torch.where(~_window_visible(n), torch.tensor(float("-inf")),
                                              s.masked_fill(~_causal_visible(n), float("-inf")))),
         "softmax over causally masked"),
        (_softmax_of(lambda s, n: s.masked_fill(~_causal_visible(n), float("-inf")).masked_fill(
            ~_window_visible(n), float("-inf"))), "softmax over causally masked"),
    ],
    ids=["causal-sdpa", "causal-mask", "hidden-norm", "prefix-sum", "sdpa-bool-mask", "sdpa-additive-mask",
         "eager-where", "eager-where-hidden-first", "eager-additive", "eager-scaled-after-mask", "eager-dropout-views",
         "hidden-reductions", "hidden-softmax", "hidden-split-cat", "empty-cat", "full-slices", "full-narrow",
         "hidden-slice",
         "hidden-index-select", "batch-unbind", "hidden-sort", "hidden-topk", "fixed-memory", "ttftc-attention", "additive-mask-at-threshold",
         "eager-fill-at-threshold", "eager-where-tensor-at-threshold", "eager-where-fill-of-one-value",
         "eager-mask-then-bias", "eager-mask-first", "sdpa-4d-mask",
         "sdpa-mask-reaching-a-node-twice",
         "eager-window-where-over-causal", "eager-window-where-hidden-first-over-causal",
         "eager-window-fill-over-causal"],
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
        (_bidirectional_sdpa,
         "bidirectional attention (aten._scaled_dot_product_flash_attention_for_cpu with is_causal=False and no mask)"),
        (lambda x: _masked_softmax(x, causal=False), "is neither causal nor a sliding window"),
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
        # a fixed-length piece (a learned prefix) is not an empty one: the positions still move
        (lambda x: torch.cat([torch.ones(x.shape[0], 4, 16), x], dim=1)[:, : x.shape[1]],
         "concatenates along the sequence axis"),
        (lambda x: F.embedding(_reversed(x.shape[1]), x[0])[None], "embedding table indexed by position"),
        (_sdpa_with(lambda n: torch.ones(n, n, dtype=torch.bool).triu()), "is neither causal nor a sliding window"),
        (_sdpa_with(lambda n: torch.ones(n, 1, dtype=torch.bool)), "lets a query see later keys"),
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
        (lambda x: x.split(x.shape[1] - 1, dim=1)[0], "split: aten.split picks positions along the sequence axis"),
        (lambda x: torch.cat(x.split([1, x.shape[1] - 1], dim=1)[::-1], dim=1),
         "aten.split_with_sizes picks positions along the sequence axis"),
        (lambda x: torch.sort(x, dim=1)[0], "sort: aten.sort reduces across the sequence axis"),
        (lambda x: _ttftc_attention(x, causal=False), "ttftc.attention with causal=False attends to later positions"),
        (_sdpa_with(lambda n: torch.arange(n)[None, :] <= torch.arange(n)[:, None] + 1),
         "the mask where lets a query see later keys"),  # each query sees the next key
        # a mask reading one position of a ramp: not a form the prover follows, so not proven
        (_sdpa_with(lambda n: _causal_visible(n) & (torch.arange(n)[7] >= 0)),
         "is not proven causal (mask uses aten.select, which the mask prover does not know)"),
        # compares positions with the length itself, a graph input the prover does not read
        (_softmax_of(lambda s, n: s.masked_fill(torch.arange(n) > n, float("-inf"))),
         "mask depends on the runtime input"),
        (_softmax_where_filled(lambda n: torch.tensor(-1.0)), "no causal mask is applied"),  # a fill that hides nothing
        # a fill computed from the length: not a constant the prover reads, so it hides nothing proven
        (_softmax_where_filled(lambda n: torch.full((), -1e30) * n), "no causal mask is applied"),
        (lambda x: _eager_attention(x, scores_to_probs=lambda s, n: torch.softmax(
            torch.where(_causal_visible(n), s, s * 0), dim=-1)), "no causal mask is applied"),  # a fill from the data
        # a fill that hides below length 6 only (-1e30 at 5, +1e31 at 16): a check at small lengths would pass it
        (_softmax_where_filled(lambda n: torch.full((), 1e30) * (n - 6)), "no causal mask is applied"),
        # a fill read from one position of a ramp is not a constant the prover follows
        (_softmax_where_filled(lambda n: torch.arange(n)[7] * -1e31),
         "softmax over the sequence axis without a proven causal mask (no causal mask is applied"),
        (_softmax_of(lambda s, n: s + 1.0), "without a proven causal mask (the mask is not a tensor computed in the graph)"),
        (_softmax_of(lambda s, n: s + torch.zeros(n, n)), "without a proven causal mask (the mask zeros lets a query see"),
        # scores from positions alone, not causal: the reason names the mask
        (lambda x: _eager_attention(x, scores_to_probs=lambda s, n: torch.softmax(torch.zeros(n, n) + 1.0, dim=-1)),
         "without a proven causal mask (the mask zeros lets a query see later keys"),
        # torch.where's condition is checked, whichever operand holds the scores: here it shows the later keys
        (_softmax_of(lambda s, n: torch.where(torch.arange(n)[None, :] >= torch.arange(n)[:, None], s, float("-inf"))),
         "without a proven causal mask (the mask ge is not proven causal (the mask is neither causal nor a sliding"),
        (_softmax_of(lambda s, n: torch.where(_causal_visible(n), torch.tensor(float("-inf")), s)),
         "is neither causal nor a sliding window"),  # hides the earlier keys, shows the later ones
        # reductions whose dim is None or empty reduce every axis, the sequence axis too
        (lambda x: x - x.var(), "var: aten.var reduces across the sequence axis"),
        (lambda x: x[:, :-1], "slices the sequence axis (0:-1:1)"),  # an end counted from the back moves with padding
        # traced at length 8, x[:, :10] leaves no slice in the graph, only Dynamo's guard that the length is below 10
        (lambda x: x[:, :10] * 2, "the trace holds only for sequence lengths in [2, 9], and bucket 16 is not"),
        # the same at the largest bucket: traced at length 8 the guard is `s < 32`, which bucket 32 fails (the slice
        # would keep every position there too, but the trace does not show it)
        (lambda x: x[:, -32:], "the trace holds only for sequence lengths in [2, 31], and bucket 32 is not"),
        (lambda x: x - x.sum(dim=[]), "aten.sum reduces across the sequence axis"),
        (lambda x: x - x[0, :, 0].sum(-1), "aten.sum reduces across the sequence axis"),  # a 1-D sequence
        # addmm's matrices are its second and third arguments (the first is the bias)
        (lambda x: x + torch.addmm(x.new_zeros(16), x[0].t(), x[0]).sum(0), "aten.addmm sums over the sequence axis"),
        # smoothing the probabilities with a uniform term reads every later value: no longer causal
        (lambda x: _eager_attention(x, scores_to_probs=_softmax_where, probs_path=lambda p: p + 1.0 / p.shape[-1]),
         "bmm_1: aten.bmm sums over the sequence axis outside a causal attention"),
    ],
    ids=["bidirectional", "anti-causal-mask", "sequence-mean", "sequence-norm", "last-position", "pooling",
         "data-dependent-sdpa-mask", "data-dependent-softmax-mask", "index", "gather", "index-select", "cat",
         "cat-fixed-prefix",
         "embedding-by-position", "sdpa-upper-mask", "sdpa-1d-mask", "causal-and-mask", "unmasked-softmax",
         "mask-fill-not-hidden", "scores-scaled-by-data", "sequence-matmul", "full-sum", "sequence-sum",
         "sequence-amax", "shifted-slice", "strided-slice", "first-position", "sequence-split",
         "sequence-split-with-sizes", "sequence-sort", "ttftc-bidirectional",
         "mask-sees-next-key", "mask-not-proven", "key-only-mask", "where-fill-not-hidden", "where-fill-grows-with-length",
         "where-fill-from-data", "where-fill-hiding-at-small-lengths-only", "where-fill-not-a-constant", "scores-plus-constant",
         "scores-plus-zeros", "positions-only-scores", "where-shows-later-keys", "where-hidden-first-shows-later-keys",
         "full-var", "drop-last-position", "slice-dropped-under-a-length-guard",
         "slice-back-the-largest-bucket", "empty-dims-sum", "one-dimensional-sum", "addmm-over-the-sequence", "smoothed-probabilities"],
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
    assert effective_buckets((16, 32, 64), 32) == (16, 32)  # the limit itself, once
    assert bucket_for(1, (16, 32)) == 16 and bucket_for(16, (16, 32)) == 16 and bucket_for(17, (16, 32)) == 32
    assert bucket_for(33, (16, 32)) is None
    with pytest.raises(ValueError, match="^a prompt needs at least one token, got length 0$"):
        bucket_for(0, (16,))


def test_a_plan_describes_itself_and_round_trips_through_a_dict():
    plan = _plan(lambda x: _eager_attention(x, scores_to_probs=_softmax_where) + _causal_sdpa(x))
    assert plan.safe and plan.reason is None
    assert plan.evidence == ("1x softmax over causally masked scores (proven)",
                             "1x probabilities @ V over causal probabilities", "1x SDPA with is_causal=True")
    assert plan.describe() == (
        "bucketing: padding proven safe; buckets [16, 32] (1x softmax over causally masked scores (proven); "
        "1x probabilities @ V over causal probabilities; 1x SDPA with is_causal=True)")
    assert BucketPlan.from_dict(plan.to_dict()) == plan
    noted = BucketPlan(True, (16,), notes=("capped",))
    assert noted.describe() == "bucketing: padding proven safe; buckets [16] (no op mixes sequence positions); capped"
    assert BucketPlan.from_dict({"safe": 1, "buckets": ["8"]}) == BucketPlan(True, (8,))
    refusal = refused((16,), "because", notes=("n",))
    assert refusal.describe() == "bucketing: refused, the graph stays dynamic: because; n"
    assert refusal.to_dict() == {"safe": False, "buckets": [16], "reason": "because", "evidence": [], "notes": ["n"]}
    assert BucketPlan.from_dict(refusal.to_dict()) == refusal


def test_the_attention_problem_is_named_first_and_the_rest_counted():
    plan = _plan(lambda x: _bidirectional_sdpa(x - x.mean(dim=1, keepdim=True))[:, 1:])
    assert not plan.safe
    assert plan.reason.endswith("(+2 more)") and "bidirectional attention" in plan.reason.split("(+")[0]


def test_evidence_counts_each_proof():
    plan = _plan(lambda x: _causal_sdpa(_causal_sdpa(x)))
    assert plan.evidence == ("2x SDPA with is_causal=True",)


class _Returns(torch.nn.Module):
    """A model whose output is `out(input_ids, position_ids)`."""

    def __init__(self, out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.out = out

    def forward(self, input_ids, position_ids=None):
        return self.out(input_ids, position_ids, self.weight)


def _graph_break(ids, positions, weight):
    hidden = ids[..., None] * weight
    torch._dynamo.graph_break()
    return hidden.sum(1, keepdim=True).expand(hidden.shape)  # reduces across the sequence axis


@pytest.mark.parametrize("model, reason", [
    # a graph break would hand over only the graph before it: the plan must refuse, not judge half the model
    (_Returns(_graph_break), "tracing with a symbolic length failed: Unsupported: "),
    (_Returns(lambda ids, positions, weight: ids),
     "tracing with a symbolic length failed: RuntimeError: the capture backend was never called: Dynamo produced no "
     "graph for the model"),
    (_Returns(lambda ids, positions, weight: positions[..., None] * weight),
     "could not find the token ids among the graph inputs"),
])
def test_a_model_that_cannot_be_analysed_as_one_graph_of_token_ids_is_refused(model, reason):
    plan = analyse_padding(model, BUCKETS, CPU, notes=("a note",))
    assert not plan.safe and plan.reason.startswith(reason) and len(plan.reason) <= 500
    assert plan.notes == ("a note",) and plan.buckets == BUCKETS


class _EveryInput(torch.nn.Module):
    def forward(self, input_ids, position_ids=None, use_cache=True, logits_to_keep=0):
        return input_ids


def test_the_prefill_adapter_reads_the_model_signature_and_defaults_to_every_logit_and_the_cache():
    toy = PrefillAdapter(_Toy(torch.nn.Identity()))
    assert (toy.logits, toy.kv) == ("all", True)
    assert (toy.takes_positions, toy.takes_use_cache, toy.takes_logits_to_keep) == (True, False, False)
    full = PrefillAdapter(_EveryInput(), logits="last", kv=False)
    assert (full.logits, full.kv) == ("last", False)
    assert (full.takes_positions, full.takes_use_cache, full.takes_logits_to_keep) == (True, True, True)
    assert not PrefillAdapter(torch.nn.Embedding(4, 2)).takes_positions


def test_example_inputs_are_a_prompt_of_the_signature_on_the_device():
    meta = torch.device("meta")
    plain = example_inputs(GraphSignature(6, batch=2), meta, PrefillAdapter(torch.nn.Embedding(4, 2)))  # no positions
    assert list(plain) == ["input_ids"]
    ids = plain["input_ids"]
    assert (ids.shape, ids.dtype, ids.device) == ((2, 6), torch.long, meta)
    cpu = example_inputs(GraphSignature(6, batch=2, logits="last"), CPU, PrefillAdapter(_Toy(torch.nn.Identity())))
    assert list(cpu) == ["input_ids", "position_ids", "last_index"]
    assert cpu["input_ids"].tolist() == [[0] * 6] * 2
    assert cpu["position_ids"].tolist() == [list(range(6))] * 2 and cpu["position_ids"].is_contiguous()
    assert cpu["last_index"].tolist() == [5, 5] and cpu["last_index"].dtype == torch.long
    on_meta = example_inputs(GraphSignature(6, batch=2, logits="last"), meta, PrefillAdapter(_Toy(torch.nn.Identity())))
    assert {name: t.device for name, t in on_meta.items()} == dict.fromkeys(cpu, meta)


def test_an_attention_problem_is_reported_first_whatever_its_place_in_the_graph():
    # the sequence mean comes first in the graph, the bidirectional attention after it: the reason leads with the
    # attention (the model's nature, not a detail), for ATen's SDPA and for ttftc.attention alike
    for attend, lead in ((lambda x: _ttftc_attention(x, causal=False), "ttftc.attention with causal=False"),
                         (_bidirectional_sdpa, "bidirectional attention")):
        plan = _plan(lambda x: attend(x - x.mean(dim=1, keepdim=True)))
        assert not plan.safe
        assert lead in plan.reason.split(";")[0] and plan.reason.endswith("(+1 more)"), plan.reason


def test_a_graph_without_a_sequence_symbol_is_refused():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    plan = plan_from_graph(gm, set(), (16,), notes=("traced with 2 layers",))
    assert plan.notes == ("traced with 2 layers",)
    assert not plan.safe
    assert plan.reason == "the sequence length was specialised during tracing, so the sequence axis is unknown"


def _size_placeholder(graph: fx.Graph, shape_env: ShapeEnv, name: str, traced: int) -> fx.Node:
    """A graph input that is a symbolic size, traced at `traced` (as Dynamo passes sizes to an aten graph)."""
    node = graph.placeholder(name)
    node.meta["val"] = shape_env.create_symintnode(shape_env.create_symbol(traced, ConstantSource(name)), hint=traced)
    return node


def test_a_mask_is_proven_for_every_length_not_only_small_ones():
    # Causal up to length 20; from 21 positions on, each query also sees the key 20 places after it.
    def mask(n):
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return (j <= i) | (j - i >= 20)

    plan = _plan(_softmax_of(lambda s, n: s.masked_fill(~mask(n), float("-inf"))))
    assert not plan.safe
    assert "is not proven causal (the mask is neither causal nor a sliding window" in plan.reason, plan.reason


@pytest.mark.parametrize("scale, safe", [(0.25, False), (2.0, True), (-2.0, False)])
def test_a_scale_after_the_mask_counts_against_its_masking_value(scale, safe):
    # -65504 scaled by 0.25 is -16376: that no longer hides a key; doubled it still does, negated it shows them.
    plan = _plan(_softmax_of(lambda s, n: s.masked_fill(~_causal_visible(n), -65504.0) * scale))
    assert plan.safe is safe, plan.reason
    if not safe:
        assert "no causal mask is applied" in plan.reason


def test_a_softmax_over_the_query_axis_is_refused_even_under_a_causal_mask():
    plan = _plan(lambda x: _eager_attention(x, scores_to_probs=lambda s, n: torch.softmax(
        s.masked_fill(~_causal_visible(n), float("-inf")), dim=-2)))
    assert not plan.safe
    assert "softmax over the sequence axis, which is not the scores' last (key) axis" in plan.reason


def _guarded_graph(guard):
    """A graph of a symbolic sequence length (traced at 8), another size (traced at 3) and the length of the
    positions (traced at 8), after Dynamo guarded on `guard(seq, width, positions)` (a SymBool, evaluated at the
    traced sizes as Dynamo does)."""
    shape_env, graph = ShapeEnv(duck_shape=False), fx.Graph()  # two sizes traced at 8 are two symbols
    seq = _size_placeholder(graph, shape_env, "seq", 8)
    width = _size_placeholder(graph, shape_env, "width", 3)
    positions = _size_placeholder(graph, shape_env, "positions", 8)
    graph.output((seq, width, positions))
    symbols = tuple(size.meta["val"].node.expr for size in (seq, width, positions))  # before a guard unifies them
    assert bool(guard(seq.meta["val"], width.meta["val"], positions.meta["val"]))
    return fx.GraphModule(torch.nn.Module(), graph), *symbols


_HOLDS_ONLY = "the trace holds only for sequence lengths "
_GUARDED = " (Dynamo guarded on it), and bucket {bucket} does not"


@pytest.mark.parametrize("guard, buckets, reason", [
    (lambda seq, width, positions: seq > 1, (16, 32), None),
    (lambda seq, width, positions: width < 5, (16, 32), None),  # a guard on another size only
    (lambda seq, width, positions: seq > width, (16, 32), None),  # the other size keeps its traced value, 3
    (lambda seq, width, positions: seq == positions, (16, 32), None),  # Dynamo unifies the two lengths
    (lambda seq, width, positions: seq == width + 5, (16, 32),
     "Dynamo rewrote the sequence length {seq} as {width} + 5"),
    (lambda seq, width, positions: seq < 10, (4, 9), None),
    (lambda seq, width, positions: seq < 10, (4, 9, 16), _HOLDS_ONLY + "in [2, 9], and bucket 16 is not"),
    (lambda seq, width, positions: seq > 5, (4, 9), _HOLDS_ONLY + "in [6, int_oo], and bucket 4 is not"),
    (lambda seq, width, positions: seq > 5, (6, 9), None),  # the range's bounds are in it
    (lambda seq, width, positions: seq % 2 == 0, (16, 32), None),
    (lambda seq, width, positions: seq % 2 == 0, (16, 33), _HOLDS_ONLY + "where Eq(Mod({seq}, 2), 0)" + _GUARDED),
    # a guard on another size first does not end the check
    (lambda seq, width, positions: bool(width < 5) and seq % 2 == 0, (16, 33),
     _HOLDS_ONLY + "where Eq(Mod({seq}, 2), 0)" + _GUARDED),
    (lambda seq, width, positions: seq * width != 60, (16, 20), _HOLDS_ONLY + "where Ne({seq}*{width}, 60)" + _GUARDED),
], ids=["trivial", "other-size-only", "relative-to-another-size", "unified-lengths", "length-as-an-expression",
        "range-holds",
        "range-excludes-a-bucket", "range-excludes-a-smaller-bucket", "range-bounds", "parity-holds",
        "parity-fails", "parity-fails-after-another-guard", "product-fails"])
def test_a_plan_holds_only_for_buckets_that_pass_the_traces_length_guards(guard, buckets, reason):
    gm, seq, width, positions = _guarded_graph(guard)  # Dynamo names the symbols (s80, s99, ...)
    expected = reason and reason.format(seq=seq, width=width, bucket=buckets[-1])
    assert plan_module.length_guard_reason(gm, {seq}, buckets) == expected


def test_each_of_two_sequence_lengths_is_checked():
    # input_ids' and position_ids' lengths left as two symbols: either may be the one a guard bounds
    gm, seq, _, positions = _guarded_graph(lambda seq, width, positions: seq < 10)
    assert plan_module.length_guard_reason(gm, {seq, positions}, (4, 9, 16)) == (
        _HOLDS_ONLY + "in [2, 9], and bucket 16 is not")


def test_the_guards_are_found_through_a_tensor_input_too():
    # A graph whose only input is the token ids [1, s]: the symbolic size lives in a tensor's shape.
    shape_env, graph = ShapeEnv(), fx.Graph()
    seq = shape_env.create_symintnode(shape_env.create_symbol(8, ConstantSource("seq")), hint=8)
    with FakeTensorMode(shape_env=shape_env):
        graph.placeholder("tokens").meta["val"] = torch.empty(1, seq, dtype=torch.long)
    graph.output(None)
    assert bool(seq < 10)
    assert plan_module.length_guard_reason(fx.GraphModule(torch.nn.Module(), graph), {seq.node.expr}, (16,)) == (
        _HOLDS_ONLY + "in [2, 9], and bucket 16 is not")


def test_without_a_symbolic_length_there_is_no_length_guard_to_check():
    graph = fx.Graph()
    graph.placeholder("tokens").meta["val"] = torch.zeros(2, 8, dtype=torch.long)
    graph.output(None)
    assert plan_module.length_guard_reason(fx.GraphModule(torch.nn.Module(), graph), set(), (16,)) is None


@pytest.mark.parametrize("mask_of_length, proven", [
    (_causal_visible, True), (lambda n: torch.ones(n, n, dtype=torch.bool).triu(), False)])
def test_an_sdpa_kernel_that_names_its_mask_attn_bias_is_checked_as_with_attn_mask(monkeypatch, mask_of_length, proven):
    # The efficient and cuDNN kernels take the mask as attn_bias; this CPU traces the flash kernel, so the test
    # retargets it to the efficient kernel, whose schema is known here, before the analysis reads the graph.
    def as_efficient_attention(gm, seq, buckets, notes=()):
        for node in gm.graph.find_nodes(op="call_function",
                                        target=aten._scaled_dot_product_flash_attention_for_cpu.default):
            node.target = aten._scaled_dot_product_efficient_attention.default
            node.args, node.kwargs = (*node.args[:3], node.kwargs["attn_mask"], False), {}
        return plan_from_graph(gm, seq, buckets, notes)

    monkeypatch.setattr(capture_module, "plan_from_graph", as_efficient_attention)
    plan = _plan(_sdpa_with(mask_of_length))
    assert plan.safe == proven, plan.reason
    if proven:
        assert plan.evidence == ("1x SDPA with a causal mask (proven)",)
    else:
        assert "attention mask not proven causal" in plan.reason


def test_a_slice_ending_at_the_largest_bucket_keeps_every_position():
    # Traced at length 8, x[:, :4] stays a slice (with the guard length >= 4); no prompt of bucket 4 loses a position.
    first_four = _Toy(lambda x: x[:, :4] * 2).eval()
    assert analyse_padding(first_four, (4,), CPU).safe
    assert analyse_padding(first_four, (6,), CPU).reason == (
        "slice_1: slices the sequence axis (0:4:1), so positions would shift with padding")


def test_a_node_whose_arguments_do_not_bind_refuses_the_plan(monkeypatch):
    # The analysis reads ops' arguments by schema name; one it cannot read is a problem, not a pass.
    monkeypatch.setattr(plan_module, "bound_arguments", lambda node: None)
    plan = _plan(lambda x: x[:, 0:] * 2)
    assert not plan.safe
    assert plan.reason.endswith(": its arguments do not bind to the schema of aten.slice")


def test_probabilities_through_dropout_are_still_recognised_as_causal():
    # native_dropout returns (output, mask): the GEMM reads the probabilities through a getitem. The dropout node
    # itself is not proven per-position (a limitation: inference graphs have no dropout), but the GEMM is proven.
    plan = _plan(lambda x: _eager_attention(x, scores_to_probs=_softmax_where,
                                            probs_path=lambda p: F.dropout(p, 0.1, training=True)))
    assert not plan.safe
    assert plan.reason == ("native_dropout: cannot prove aten.native_dropout keeps sequence positions independent")
    assert "1x probabilities @ V over causal probabilities" in plan.evidence


def test_a_gemm_over_the_sequence_axis_of_a_graph_input_is_refused():
    # The left operand leads, through a cast and views only, to the token ids themselves: no softmax at all.
    model = _Returns(lambda ids, positions, weight: (ids.float().unsqueeze(1) @ torch.ones(ids.shape[1], 4)) * weight)
    plan = analyse_padding(model, BUCKETS, CPU)
    assert not plan.safe
    assert plan.reason == "mm: aten.mm sums over the sequence axis outside a causal attention"


def test_an_sdpa_whose_arguments_cannot_be_read_refuses_the_plan(monkeypatch):
    monkeypatch.setattr(plan_module, "normalize_function", lambda *args, **kwargs: None)
    plan = _plan(_causal_sdpa)
    assert not plan.safe
    assert plan.reason.endswith(": could not read the arguments of aten._scaled_dot_product_flash_attention_for_cpu")
