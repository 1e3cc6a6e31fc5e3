"""The bucketed model: padded runs equal unpadded eager at every real position, and warm buckets never recompile."""

import random
import threading
from types import SimpleNamespace

import pytest
import torch

import ttftc
from tests.graph_checks import lowered_ops
from tests.helpers import assert_logits_match, needs_transformers, zoo_cases
from ttftc import zoo
from ttftc.buckets.table import DEFAULT_BUCKETS
from ttftc.bucketed import BucketedModel, PromptTooLongError, compile_bucketed

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


class _KeepsTenPositions(torch.nn.Module):
    """token ids -> per-token scores of the first 10 positions only: not one output per token, as an LM has."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)

    def forward(self, input_ids, position_ids=None):
        return self.embed(input_ids)[:, :10]


def test_a_model_that_drops_positions_gets_no_buckets_and_a_clear_error():
    # Traced at length 8, the slice leaves only Dynamo's guard `length < 10` in the graph: no bucket may rely on it.
    bucketed = compile_bucketed(_KeepsTenPositions().eval(), ttftc.Config(buckets=(16, 32)), cache=None)
    assert not bucketed.plan.safe
    assert bucketed.plan.reason == "the trace holds only for sequence lengths in [2, 9], and bucket 16 is not"
    with pytest.raises(ValueError, match=r"^the model returned 10 positions \(dim 1 of \(1, 10, 8\)\) for a 12-token "
                                         r"prompt; the bucketed runtime needs one per token"):
        bucketed(torch.randint(0, 32, (1, 12)))


def test_dropping_unused_constants_keeps_read_ones_and_leaves_submodules_alone():
    from ttftc.buckets.capture import _drop_unused_constants

    root = torch.nn.Module()
    root.register_buffer("read", torch.ones(2))
    root.register_buffer("unread", torch.zeros(2))
    root.inner = torch.nn.Module()
    root.inner.register_buffer("own", torch.ones(2))  # the submodule's, not a constant of the graph
    graph = torch.fx.Graph()
    graph.output(graph.call_function(torch.add, (graph.placeholder("x"), graph.get_attr("read"))))
    gm = torch.fx.GraphModule(root, graph)
    gm.inner = root.inner
    _drop_unused_constants(gm)
    assert [name for name, _ in gm.named_buffers()] == ["read", "inner.own"]
    assert torch.equal(gm(torch.ones(2)), torch.full((2,), 2.0))


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
                                       ("norm", "cpu"): 2 + 1, ("gated_ffn", "cpu"): 2, ("rope", "cpu"): 2 * 2}
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


def test_a_prompt_run_without_use_cache_has_a_graph_without_kv():
    bucketed = compile_bucketed(_TinyLM().eval(), ttftc.Config(buckets=(16,)), cache=None)
    assert bucketed.plan.safe, bucketed.plan.reason
    ids = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(0))
    without, with_kv = bucketed(ids, use_cache=False), bucketed(ids)
    assert without.bucket == with_kv.bucket == 16
    assert without.past_key_values is None and len(with_kv.past_key_values) == 1
    assert torch.equal(without.logits, with_kv.logits)


class _TinyLMWindowedCache(_TinyLM):
    """_TinyLM whose cache keeps only the last 4 positions, as a sliding-window cache does: padded, it would keep
    padding's keys. Its logits alone would be safe to pad."""

    def forward(self, input_ids, position_ids=None, use_cache=True):
        out = super().forward(input_ids, position_ids, use_cache)
        if use_cache:
            out.past_key_values = tuple((k[:, :, -4:], v[:, :, -4:]) for k, v in out.past_key_values)
        return out


def test_the_plan_checks_the_kv_outputs_too():
    bucketed = compile_bucketed(_TinyLMWindowedCache().eval(), ttftc.Config(buckets=(16,)), cache=None)
    assert not bucketed.plan.safe
    assert "slices the sequence axis" in bucketed.plan.reason, bucketed.plan.reason


def test_the_plan_keeps_the_callers_notes():
    from ttftc.buckets.capture import analyse_padding

    plan = analyse_padding(_TinyLM().eval(), (16,), torch.device("cpu"), notes=("a note",))
    assert plan.safe and plan.notes == ("a note",)


def test_a_plan_that_cannot_name_the_token_ids_is_refused():
    from ttftc.buckets.capture import analyse_padding

    plan = analyse_padding(_Subclassed().eval(), (16,), torch.device("cpu"), notes=("a note",))
    assert (plan.safe, plan.buckets, plan.reason, plan.notes) == (
        False, (16,), "could not find the token ids among the graph inputs", ("a note",))


class _GraphBreaking(_TinyLM):
    def forward(self, input_ids, position_ids=None, use_cache=True):
        torch._dynamo.graph_break()
        return super().forward(input_ids, position_ids, use_cache)


def test_a_model_that_does_not_trace_as_one_graph_is_refused():
    from ttftc.buckets.capture import analyse_padding

    plan = analyse_padding(_GraphBreaking().eval(), (16,), torch.device("cpu"), notes=("a note",))
    assert (plan.safe, plan.buckets, plan.notes) == (False, (16,), ("a note",))
    assert plan.reason.startswith("tracing with a symbolic length failed: Unsupported: "), plan.reason


def test_the_padding_analysis_traces_without_compiling(monkeypatch):
    from ttftc.buckets.capture import analyse_padding
    from ttftc.dynamo_backend import TtftcBackend

    def compile_refused(*args):
        raise AssertionError("the padding analysis compiled its graph")

    monkeypatch.setattr(TtftcBackend, "_compile_real", compile_refused)
    assert analyse_padding(_TinyLM().eval(), (16,), torch.device("cpu")).safe


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


class _Counting(torch.nn.Module):
    """Updates a plain tensor attribute (neither parameter nor buffer) at each call: a graph input under Dynamo."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.calls = torch.ones(4)

    def forward(self, input_ids):
        self.calls.add_(1)
        return self.embed(input_ids) * self.calls


_GLOBAL_SHIFT = torch.ones(4)


class _ReadsAGlobalLM(_TinyLM):
    """_TinyLM plus a shift read from a global variable, which Dynamo passes in as a graph input."""

    def forward(self, input_ids, position_ids=None, use_cache=True):
        out = super().forward(input_ids, position_ids, use_cache)
        out.logits = out.logits + _GLOBAL_SHIFT.sum()
        return out


@pytest.mark.parametrize("model, names", [(_Counting, "[None, 'input_ids']"),
                                          (_ReadsAGlobalLM, "['input_ids', 'position_ids', None]")])
def test_a_model_that_reads_state_outside_its_weights_cannot_be_captured(model, names):
    from ttftc.buckets.capture import capture_graph
    from ttftc.buckets.program import GraphSignature

    message = (f"the prefill graph reads inputs other than the prompt tensors ({names}); it cannot run without "
               "Dynamo. This happens when a model keeps mutable state (e.g. a static cache) inside the module, or "
               "reads a tensor from a global variable: register such a tensor as a buffer of the model, or use "
               "Config(buckets=None).")
    with pytest.raises(RuntimeError) as raised:
        capture_graph(model().eval(), GraphSignature(8), ttftc.Config(), torch.device("cpu"))
    assert str(raised.value) == message


def test_weights_and_globals_that_dynamo_installs_on_the_graph_are_not_taken_for_prompt_tensors():
    # With install_free_tensors, Dynamo makes weights and globals attributes of its graph, and AOTAutograd passes
    # them in ahead of the prompt tensors: the capture must count them to name the prompt tensors right.
    model = _ReadsAGlobalLM().eval()
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(install_free_tensors=True):
        bucketed = compile_bucketed(model, ttftc.Config(buckets=(16,), precision="fp32"), cache=None)
        assert bucketed.plan.safe, bucketed.plan.reason
        out = bucketed(ids)
    positions = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        expected = model(ids, positions)
    assert out.bucket == 16
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(out.past_key_values[0][0], expected.past_key_values[0][0])


class _TinyLMCacheOff(_TinyLM):
    """_TinyLM whose forward leaves the cache off unless asked, as an HF model whose config says use_cache=False."""

    def forward(self, input_ids, position_ids=None, use_cache=False):
        return super().forward(input_ids, position_ids, use_cache)


def test_the_callers_use_cache_wins_over_the_models_default():
    model = _TinyLMCacheOff().eval()
    bucketed = compile_bucketed(model, ttftc.Config(buckets=(16,), precision="fp32"), cache=None)
    ids = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(0))
    out = bucketed(ids, use_cache=True)
    with torch.no_grad():
        expected = model(ids, torch.arange(5)[None], use_cache=True)
    (keys, values), = out.past_key_values
    torch.testing.assert_close(keys, expected.past_key_values[0][0])
    torch.testing.assert_close(values, expected.past_key_values[0][1])
    assert bucketed(ids, use_cache=False).past_key_values is None


def test_graph_inputs_without_a_dynamo_source_stay_unnamed():
    import torch.fx as fx

    from ttftc.buckets.capture import _Captured, _CaptureBackend

    class Add(torch.nn.Module):
        def forward(self, a, b, c):
            return (a + b + c,)

    gm = fx.symbolic_trace(Add())
    first, second, _ = [n for n in gm.graph.nodes if n.op == "placeholder"]  # the third has no grapharg at all
    first.meta["grapharg"] = SimpleNamespace(source=SimpleNamespace(name="L['input_ids']"))
    second.meta["grapharg"] = SimpleNamespace(source=None)
    seen = []
    backend = _CaptureBackend(ttftc.Config(passes=()), observe=lambda graph, names: seen.append(names),
                              compile_graph=False)
    with pytest.raises(_Captured):
        backend(gm, [torch.ones(2), torch.ones(2), torch.ones(2)])
    assert seen == [["input_ids", None, None]]


class _Subclassed(torch.nn.Module):
    """A model with a tensor-subclass weight, which AOTAutograd flattens into two inputs, shifting every later input's
    position by one."""

    def __init__(self):
        from torch.testing._internal.two_tensor import TwoTensor

        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        weight = torch.randn(4, 4)
        self.proj = torch.nn.Parameter(TwoTensor(weight, weight.clone()), requires_grad=False)

    def forward(self, input_ids):
        return self.embed(input_ids) @ self.proj


def test_a_model_with_tensor_subclass_weights_is_refused_not_misnamed():
    from ttftc.buckets.capture import capture_graph
    from ttftc.buckets.program import GraphSignature

    message = ("the prefill graph takes 4 inputs after AOTAutograd where Dynamo's took 3, so ttftc cannot tell "
               "which prompt tensor each one is. Tensor subclasses (e.g. quantised weights) cause this: use plain "
               "tensors, or Config(buckets=None).")
    with pytest.raises(RuntimeError) as raised:
        capture_graph(_Subclassed().eval(), GraphSignature(8), ttftc.Config(), torch.device("cpu"))
    assert str(raised.value) == message


class _Configured(torch.nn.Module):
    """A model with an HF-like `config` (any attributes) and, optionally, a token embedding of `vocab` rows."""

    def __init__(self, vocab=None, **config):
        super().__init__()
        self.config = SimpleNamespace(**config)
        if vocab is not None:
            self.embed = torch.nn.Embedding(vocab, 2)
            self.get_input_embeddings = lambda: self.embed


def test_what_compiled_graphs_read_from_a_model():
    from ttftc.buckets.compiled import model_device
    from ttftc.buckets.model_info import max_positions_of, vocab_size_of

    assert max_positions_of(_Configured(max_position_embeddings=1, n_positions=64)) == 1
    assert max_positions_of(_Configured(max_position_embeddings=0, n_positions=64)) == 64
    assert max_positions_of(_Configured(max_position_embeddings=512.0)) is None
    assert max_positions_of(torch.nn.Linear(2, 2)) is None
    text = SimpleNamespace(vocab_size=70)
    assert vocab_size_of(_Configured(vocab=50, vocab_size=99)) == 50  # the embedding's rows win
    assert vocab_size_of(_Configured(vocab_size=1)) == 1
    assert vocab_size_of(_Configured(vocab_size=99, get_text_config=lambda: text)) == 70  # a multimodal config
    assert [vocab_size_of(_Configured(vocab_size=v)) for v in (0, None, 8.0)] == [None, None, None]
    assert vocab_size_of(torch.nn.Linear(2, 2)) is None
    assert model_device(torch.nn.Linear(2, 2), ttftc.Config(device="cuda")) == torch.device("cuda")
    assert model_device(torch.nn.Linear(2, 2, device="meta"), ttftc.Config()) == torch.device("meta")
    assert model_device(torch.nn.ReLU(), ttftc.Config()) == torch.device("cpu")  # no parameters


class _FakeCache:
    """A compile cache in a dict, recording what is asked of it."""

    def __init__(self):
        self.calls, self.plans, self.graphs = [], {}, {}

    def load_plan(self, model, device, buckets):
        self.calls.append(("load_plan", model, device, buckets))
        return self.plans.get(buckets)

    def store_plan(self, model, device, buckets, plan):
        self.calls.append(("store_plan", model, device, buckets, plan))
        self.plans[buckets] = plan

    def load_graph(self, model, config, signature, device):
        self.calls.append(("load_graph", model, config, signature, device))
        return self.graphs.get(signature)

    def store_graph(self, model, config, program, device):
        self.calls.append(("store_graph", model, config, program, device))
        self.graphs[program.signature] = program


def test_compiled_graphs_plan_once_with_capped_buckets_and_keep_the_plan_in_the_cache(monkeypatch):
    from ttftc.buckets import compiled
    from ttftc.buckets.plan import refused

    analysed = []

    def fake_analyse(model, buckets, device, notes):
        analysed.append((model, buckets, device, list(notes)))
        return refused(buckets, "fake", notes)

    monkeypatch.setattr(compiled, "analyse_padding", fake_analyse)
    cpu, cache = torch.device("cpu"), _FakeCache()
    model = _Configured(vocab=8, max_position_embeddings=24)
    source = compiled.CompiledGraphs(model, ttftc.Config(buckets=(16, 32, 64)), cache=cache)
    assert (source.max_positions, source.vocab_size, source.takes_positions) == (24, 8, False)
    assert compiled.CompiledGraphs(_TinyLM(), ttftc.Config()).takes_positions
    plan = source.plan
    assert source.plan is plan and plan.buckets == (16, 24)
    capped = ["buckets above the model's 24 positions were capped to it"]
    assert analysed == [(model, (16, 24), cpu, capped)]
    assert cache.calls == [("load_plan", model, cpu, (16, 24)), ("store_plan", model, cpu, (16, 24), plan)]
    assert compiled.CompiledGraphs(model, ttftc.Config(buckets=(16, 32, 64)), cache=cache).plan is plan  # cached
    assert len(analysed) == 1
    uncapped = compiled.CompiledGraphs(model, ttftc.Config(buckets=(8, 16)), cache=None).plan
    assert uncapped.buckets == (8, 16) and analysed[-1] == (model, (8, 16), cpu, [])
    assert compiled.CompiledGraphs(_Configured(vocab=8), ttftc.Config(), cache=None).plan.buckets == DEFAULT_BUCKETS


def test_compiled_graphs_compile_each_signature_once_and_load_what_the_cache_holds(monkeypatch):
    from ttftc.buckets import compiled
    from ttftc.buckets.program import GraphProgram, GraphSignature
    from ttftc.report import Report

    captured = []

    def fake_capture(model, signature, config, device):
        gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        gm.register_buffer("weight", torch.ones(3))  # the same constant in every graph
        captured.append((model, signature, config, device))
        return GraphProgram(signature, gm, ["input_ids"], ["logits"]), Report(graphs=1)

    monkeypatch.setattr(compiled, "capture_graph", fake_capture)
    cpu, cache, config = torch.device("cpu"), _FakeCache(), ttftc.Config(buckets=(16, 32))
    model = _Configured(vocab=8)
    signatures = [GraphSignature(16), GraphSignature(32, logits="last")]
    source = compiled.CompiledGraphs(model, config, cache=cache)
    programs = [source.get(s) for s in signatures + signatures]
    assert programs[2:] == programs[:2] and source.programs == dict(zip(signatures, programs[:2]))
    assert captured == [(model, s, config, cpu) for s in signatures]
    assert source.compiles == 2 and source.cache_hits == 0 and source.reports == [Report(graphs=1)] * 2
    assert len(source.pool.tensors) == 1 and programs[1].gm.weight is programs[0].gm.weight
    assert [c for c in cache.calls if c[0] == "store_graph"] == [("store_graph", model, config, p, cpu)
                                                                 for p in programs[:2]]
    warm = compiled.CompiledGraphs(model, config, cache=cache)
    assert [warm.get(s) for s in signatures] == programs[:2] and len(captured) == 2
    assert warm.cache_hits == 2 and warm.compiles == 0 and warm.reports == [] and len(warm.pool.tensors) == 1
    assert cache.calls[-1] == ("load_graph", model, config, signatures[1], cpu)
    cold = compiled.CompiledGraphs(model, config, cache=None)
    assert cold.get(signatures[0]).signature == signatures[0] and cold.compiles == 1 and len(captured) == 3


class _CountingLock:
    """A lock that counts the threads that asked for it, so a test can wait until a second one is queued."""

    def __init__(self):
        self.lock, self.asked, self.changed = threading.Lock(), 0, threading.Condition()

    def __enter__(self):
        with self.changed:
            self.asked += 1
            self.changed.notify_all()
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()

    def wait_for(self, asked):
        with self.changed:
            assert self.changed.wait_for(lambda: self.asked >= asked, timeout=60)


def test_two_threads_asking_for_the_same_cold_graph_compile_it_once(monkeypatch):
    from ttftc.buckets import compiled
    from ttftc.buckets.program import GraphProgram, GraphSignature
    from ttftc.report import Report

    source = compiled.CompiledGraphs(_Configured(vocab=8), ttftc.Config(buckets=(16,)), cache=None)
    source._lock = lock = _CountingLock()
    captured = []

    def fake_capture(model, signature, config, device):
        captured.append(signature)
        lock.wait_for(2)  # the second thread missed the graph too and waits for the lock this compile holds
        return GraphProgram(signature, torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), [], []), Report()

    monkeypatch.setattr(compiled, "capture_graph", fake_capture)
    results = []
    threads = [threading.Thread(target=lambda: results.append(source.get(GraphSignature(16)))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert captured == [GraphSignature(16)] and source.compiles == 1
    assert len(results) == 2 and results[0] is results[1]
