"""The compiled KV path's graphs (dynamic shapes) in the compile cache: a second compile of the same model loads every
graph instead of compiling it, and the loaded graphs compute what the compiled ones did, and what eager does, at
several chunk lengths n and KV lengths."""

import json

import pytest
import sympy
import torch
from torch.utils._sympy.functions import Max as SympyMax

import ttftc
from tests.helpers import needs_transformers
from ttftc import zoo
from ttftc.cache import CompileCache
from ttftc.capture import GuardError, encode_guards
from ttftc.cache.dynamic_graphs import DynamicGraphCache
from ttftc.dynamo_backend import TtftcBackend
from ttftc.runtime.kv import new_cache, reserve

pytestmark = needs_transformers
# (chunk length, tokens already in the KV cache before it): a cold prefill, two continuations, decodes; then a cold
# one-token prompt and its decode, since sizes of 1 get graphs of their own.
CHUNKS = ((13, 0), (11, 13), (1, 24), (1, 25), (5, 26))
ONE_TOKEN = ((1, 0), (1, 1))


def forwards(model, chunks) -> list[torch.Tensor]:
    """The last-token logits of each chunk, fed in order through one growable KV cache (as the serving engine does)."""
    vocab = model.config.vocab_size
    cache, out = new_cache(model), []
    for n, start in chunks:
        ids = torch.tensor([[(7 * (start + i) + 3) % vocab for i in range(n)]])
        positions = torch.arange(start, start + n).unsqueeze(0)
        reserve(cache, start + n)
        with torch.no_grad():
            result = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                           logits_to_keep=1)
        out.append(result.logits[0, -1].float().clone())
    return out


def compile_kv(model, root):
    backend = TtftcBackend(ttftc.Config(precision="fp32"), graph_cache=DynamicGraphCache(CompileCache(root), model))
    return backend, torch.compile(model, backend=backend, dynamic=True)


@pytest.mark.slow
def test_a_second_compile_loads_every_kv_graph_and_computes_the_same_logits(tmp_path):
    model = zoo.build("llama", "sdpa")
    eager = forwards(model, CHUNKS) + forwards(model, ONE_TOKEN)
    first, compiled_model = compile_kv(model, tmp_path)
    compiled = forwards(compiled_model, CHUNKS) + forwards(compiled_model, ONE_TOKEN)
    graphs = len(first.reports)
    assert graphs >= 2 and first.graphs_loaded == 0
    stored = [json.loads(f.read_text())["dynamic"] for f in (tmp_path / "entries").glob("*.json")]
    assert sum(map(len, stored)) == graphs, "every KV graph was stored (one traced graph may have several variants)"

    torch._dynamo.reset()  # as a new process: Dynamo traces again, and the backend finds each graph in the cache
    second, loaded_model = compile_kv(model, tmp_path)
    loaded = forwards(loaded_model, CHUNKS) + forwards(loaded_model, ONE_TOKEN)
    assert (len(second.reports), second.graphs_loaded) == (0, graphs), "nothing compiled, every graph loaded"
    for i, (want_compiled, want_eager, got) in enumerate(zip(compiled, eager, loaded)):
        torch.testing.assert_close(got, want_compiled, rtol=0, atol=1e-6, msg=f"forward {i}: loaded vs compiled")
        torch.testing.assert_close(got, want_eager, rtol=1e-4, atol=1e-4, msg=f"forward {i}: loaded vs eager")


def test_a_loaded_graph_whose_guards_fail_here_is_compiled_instead(tmp_path, monkeypatch):
    """The guards a compile added are part of what a stored graph assumes: where they do not hold, it is not used."""
    model = zoo.build("llama", "sdpa")
    first, compiled_model = compile_kv(model, tmp_path)
    forwards(compiled_model, ONE_TOKEN)
    torch._dynamo.reset()
    monkeypatch.setattr("ttftc.dynamo_backend.guards_hold", lambda guards, description: False)
    second, loaded_model = compile_kv(model, tmp_path)
    forwards(loaded_model, ONE_TOKEN)
    assert second.graphs_loaded == 0 and len(second.reports) == len(first.reports)


def test_a_guard_is_stored_as_the_comparisons_it_asserts_and_only_in_forms_ttftc_reads_back():
    s0, s1 = sympy.Symbol("s0", integer=True), sympy.Symbol("s1", integer=True)
    symbols = {"s0": ("input", 0), "s1": ("size", 3, 2)}
    conjunction = sympy.And(s0 <= s1, sympy.Ne(16 * s1, 16 * SympyMax(1, s0 + 1)))
    encoded = encode_guards(conjunction, symbols)
    assert [next(iter(g)) for g in encoded] == ["le", "ne"]
    assert {"symbol": ["size", 3, 2]} in encoded[0]["le"] and {"symbol": ["input", 0]} in encoded[0]["le"]
    for unreadable in (sympy.Or(s0 < 1, s1 < 1), sympy.Eq(sympy.Symbol("s9") + 1, 2), sympy.Eq(s0 ** 2, 4),
                       sympy.Eq(s0, sympy.Rational(1, 2))):
        with pytest.raises(GuardError):
            encode_guards(unreadable, symbols)
