"""The bucketed model: padded runs equal unpadded eager at every real position, and warm buckets never recompile."""

import random

import pytest
import torch

import ttftc
from tests.graph_checks import lowered_ops
from tests.helpers import assert_logits_match, needs_transformers, zoo_cases
from ttftc import zoo
from ttftc.runtime.bucketed import BucketedModel, PromptTooLongError, compile_bucketed

pytestmark = needs_transformers


def _eager(model, ids):
    with torch.no_grad():
        out = model(ids)
    layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return out.logits, layers


def _assert_kv_match(actual, expected, *, positions=slice(None), row=0):
    assert len(actual) == len(expected)
    for (k, v), (ek, ev) in zip(actual, expected):
        assert_logits_match(k[row:row + 1, :, positions], ek)
        assert_logits_match(v[row:row + 1, :, positions], ev)


@pytest.mark.parametrize("family, attn", zoo_cases())
def test_padded_matches_unpadded_eager(family, attn):
    model = zoo.build(family, attn)
    bucketed = compile_bucketed(model, ttftc.Config(buckets=(16, 32)), cache=None)
    assert bucketed.plan.safe, bucketed.plan.reason
    for length in (3, 11, 16):  # all in the 16-token bucket: one compile, padding of 13, 5 and 0 tokens
        ids = zoo.example_ids(model, length, seed=length)
        out = bucketed(ids)
        logits, kv = _eager(model, ids)
        assert out.bucket == 16 and out.logits.shape == logits.shape
        assert_logits_match(out.logits, logits)
        _assert_kv_match(out.past_key_values, kv)
        assert out.kv_len.tolist() == [length]
    assert bucketed.source.compiles == 1


def test_batch_of_different_lengths_uses_each_sequences_length():
    model = zoo.build("llama", "sdpa")
    bucketed = compile_bucketed(model, ttftc.Config(buckets=(16,)), cache=None)
    lengths = [5, 12, 9]
    width = max(lengths)
    prompts = [zoo.example_ids(model, n, seed=n) for n in lengths]
    for side in ("right", "left"):
        ids = torch.zeros(len(lengths), width, dtype=torch.long)
        mask = torch.zeros(len(lengths), width, dtype=torch.long)
        starts = []
        for b, (n, p) in enumerate(zip(lengths, prompts)):
            start = 0 if side == "right" else width - n
            ids[b, start:start + n], mask[b, start:start + n] = p[0], 1
            starts.append(start)
        full = bucketed(ids, attention_mask=mask)
        last = bucketed(ids, attention_mask=mask, logits_to_keep=1)
        assert full.kv_len.tolist() == lengths and last.logits.shape == (len(lengths), 1, model.config.vocab_size)
        for b, (n, p, start) in enumerate(zip(lengths, prompts, starts)):
            logits, kv = _eager(model, p)
            real = slice(start, start + n)
            assert_logits_match(full.logits[b:b + 1, real], logits)
            _assert_kv_match(full.past_key_values, kv, positions=real, row=b)
            assert_logits_match(last.logits[b:b + 1, 0], logits[:, -1])


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # rotary and learned absolute positions
def test_caller_position_ids_are_used_for_every_row(family):
    model = zoo.build(family, "sdpa")
    bucketed = compile_bucketed(model, ttftc.Config(buckets=(16,)), cache=None)
    assert bucketed.source.takes_positions
    lengths, width = (6, 9), 9
    prompts = [zoo.example_ids(model, n, seed=n) for n in lengths]
    # Rotary embeddings only see differences of positions, so the given ones are not a plain shift of 0..n-1.
    offsets = (7, 30)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    positions = torch.zeros(2, width, dtype=torch.long)
    for b, (n, p, offset) in enumerate(zip(lengths, prompts, offsets)):
        start = width - n  # left padding: positions are given in the caller's layout too
        ids[b, start:], mask[b, start:] = p[0], 1
        positions[b, start:] = offset + 2 * torch.arange(n)
    out = bucketed(ids, attention_mask=mask, position_ids=positions)
    default = bucketed(ids, attention_mask=mask)
    for b, (n, p, offset) in enumerate(zip(lengths, prompts, offsets)):
        real = slice(width - n, width)
        with torch.no_grad():
            expected = model(p, position_ids=(offset + 2 * torch.arange(n))[None]).logits
        assert_logits_match(out.logits[b:b + 1, real], expected)
        assert not torch.allclose(default.logits[b:b + 1, real], expected, atol=1e-3)  # the offsets matter


def test_bucket_graphs_are_fused_and_lowered():
    model = zoo.build("llama", "sdpa")
    bucketed = compile_bucketed(model, ttftc.Config(buckets=(16,)), cache=None)
    ids = zoo.example_ids(model, 9)
    assert_logits_match(bucketed(ids, logits_to_keep=1).logits[:, 0], _eager(model, ids)[0][:, -1])
    (program,) = bucketed.source.programs.values()
    # Per layer: norm+q|k|v, attention, o_proj, norm, gate|up|down. Then the final norm and the lm_head, apart:
    # the lm_head reads only each sequence's last row (logits_to_keep=1), picked between the two.
    assert lowered_ops(program.gm) == {("norm_linear", "cpu"): 2, ("attention", "cpu"): 2, ("linear", "cpu"): 2 + 1,
                                       ("norm", "cpu"): 2 + 1, ("gated_ffn", "cpu"): 2}
    (report,) = bucketed.source.reports
    assert report.providers["attention"] == {"cpu": 2} and report.providers["gated_ffn"] == {"cpu": 2}


def test_zero_recompiles_across_random_lengths():
    from torch._dynamo.utils import counters

    model = zoo.build("llama", "sdpa")
    bucketed = compile_bucketed(model, ttftc.Config(buckets=(16, 32, 64)), cache=None)
    bucketed.warmup(logits_to_keep=(1,))
    assert bucketed.source.compiles == 3
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    rng = random.Random(0)
    lengths = [rng.randint(1, 64) for _ in range(24)]
    for i, length in enumerate(lengths):
        ids = zoo.example_ids(model, length, seed=i)
        out = bucketed(ids, logits_to_keep=1)
        if i % 6 == 0:  # spot-check values; the point here is the counters
            assert_logits_match(out.logits[:, 0], _eager(model, ids)[0][:, -1])
    assert counters["frames"]["total"] == frames, "Dynamo traced a frame after warm-up"
    assert counters["stats"]["unique_graphs"] == graphs, "a graph was compiled after warm-up"
    assert bucketed.source.compiles == 3
    assert len(set(lengths)) >= 15


def test_prompt_longer_than_largest_bucket():
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 20)
    strict = compile_bucketed(model, ttftc.Config(buckets=(16,)), cache=None)
    with pytest.raises(PromptTooLongError, match=r"20 tokens is longer than the largest bucket \(16\).*on_oversize"):
        strict(ids)
    dynamic = compile_bucketed(model, ttftc.Config(buckets=(16,), on_oversize="dynamic"), cache=None)
    out = dynamic(ids)
    assert out.bucket is None
    assert_logits_match(out.logits, _eager(model, ids)[0])


def test_bad_inputs_are_rejected_clearly():
    model = zoo.build("llama", "sdpa")
    bucketed = compile_bucketed(model, ttftc.Config(buckets=(16,)), cache=None)
    ids = zoo.example_ids(model, 6, batch=2)
    with pytest.raises(ValueError, match="has gaps"):
        bucketed(ids, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="no tokens"):
        bucketed(ids, attention_mask=torch.tensor([[0] * 6, [1] * 6]))
    with pytest.raises(ValueError, match="logits_to_keep=3"):
        bucketed(ids, logits_to_keep=3)
    single = bucketed(ids[0], logits_to_keep=1)  # a 1-D prompt is a batch of one
    assert single.logits.shape == (1, 1, model.config.vocab_size)


def test_ttftc_compile_with_buckets_returns_the_bucketed_model(monkeypatch, tmp_path):
    monkeypatch.setenv("TTFTC_COMPILE_CACHE", str(tmp_path))
    model = zoo.build("gpt2", "sdpa")
    compiled = ttftc.compile(model, ttftc.Config(buckets=(8, 16)))
    assert isinstance(compiled, BucketedModel)
    ids = zoo.example_ids(model, 7)
    assert_logits_match(compiled(ids).logits, _eager(model, ids)[0])


def test_refused_model_runs_each_prompt_at_its_own_length():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=64)).eval()
    bucketed = compile_bucketed(bert, ttftc.Config(buckets=(16,)), cache=None)
    assert not bucketed.plan.safe
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    out = bucketed(ids, attention_mask=mask, use_cache=False)
    assert out.bucket is None
    with torch.no_grad():
        for b, n in enumerate((7, 4)):
            expected = bert(ids[b:b + 1, :n]).last_hidden_state
            assert_logits_match(out.logits[b:b + 1, :n], expected)


class _TinyLM(torch.nn.Module):
    """A causal LM in miniature, quick to trace: per-token logits and one layer's keys and values (a legacy tuple
    cache), which it returns only when asked to (use_cache)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32)

    def forward(self, input_ids, position_ids=None, use_cache=True):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.embed(input_ids) + position_ids[..., None]
        keys = hidden[:, None] * 2
        return CausalLMOutputWithPast(logits=self.head(hidden), past_key_values=((keys, -keys),) if use_cache else None)


class _RecordingBackend:
    """Stands in for TtftcBackend: keeps its config and, per graph it is handed, whether the graph's sizes are
    symbolic; runs the graph as it is."""

    made: list = []

    def __init__(self, config):
        self.config, self.symbolic = config, []
        _RecordingBackend.made.append(self)

    def __call__(self, gm, example_inputs):
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        self.symbolic.append(any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and any(
            isinstance(size, torch.SymInt) for size in v.shape)) for v in values))
        return gm.forward


def test_the_dynamic_runner_compiles_the_prefill_with_the_ttftc_backend_and_symbolic_sizes(monkeypatch):
    from ttftc.buckets.compiled import dynamic_runner

    monkeypatch.setattr("ttftc.dynamo_backend.TtftcBackend", _RecordingBackend)
    monkeypatch.setattr(_RecordingBackend, "made", [])
    model, config = _TinyLM().eval(), ttftc.Config(buckets=(16,))
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    tensors = {"input_ids": ids, "position_ids": torch.arange(5).expand(2, 5), "last_index": torch.tensor([4, 2])}
    with torch.no_grad():
        expected = model(ids, tensors["position_ids"])
        last = dynamic_runner(model, config, "last", False)(tensors)
        full = dynamic_runner(model, config, "all", True)(tensors)
    assert list(last) == ["logits"]
    assert torch.equal(last["logits"], expected.logits[[0, 1], [4, 2]][:, None])
    assert list(full) == ["logits", "k0", "v0"] and torch.equal(full["logits"], expected.logits)
    assert torch.equal(full["k0"], expected.past_key_values[0][0]) and torch.equal(full["v0"], expected.past_key_values[0][1])
    assert [(b.config, b.symbolic) for b in _RecordingBackend.made] == [(config, [True]), (config, [True])]


def test_compiled_graphs_make_one_dynamic_runner_per_output_kind(monkeypatch):
    from ttftc.buckets import compiled

    made = []

    def fake_runner(model, config, logits, kv):
        made.append((model, config, logits, kv))
        return lambda tensors: (logits, kv)

    monkeypatch.setattr(compiled, "dynamic_runner", fake_runner)
    model, config = _TinyLM(), ttftc.Config(buckets=(16,))
    source = compiled.CompiledGraphs(model, config)
    last, full = source.dynamic("last", False), source.dynamic("all", True)
    assert last({}) == ("last", False) and full({}) == ("all", True)
    assert source.dynamic("last", False) is last and source.dynamic("all", True) is full
    assert made == [(model, config, "last", False), (model, config, "all", True)]
