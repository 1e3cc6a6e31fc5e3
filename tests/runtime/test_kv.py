"""The preallocated KV layer (GrowableLayer): appends written in place, eager and compiled, with eager's numbers."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils
from transformers import DynamicCache

import ttftc
from tests.helpers import assert_logits_match
from tests.passes.ffn_norm_support import CapturingBackend
from ttftc import zoo
from ttftc.runtime import PrefillEngine, PrefixCache
from ttftc.runtime.kv import GrowableLayer, new_cache, reserve

aten = torch.ops.aten


def _states(n: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 4, generator=gen).to(dtype), torch.randn(1, 2, n, 4, generator=gen).to(dtype)


# ---- the layer, eager ---------------------------------------------------------------------------------------------

def test_appends_write_into_one_buffer_and_never_touch_views_handed_out():
    layer = GrowableLayer()
    layer.allocate(10, 1, 2, 4, 4, torch.float32, torch.device("cpu"))
    k1, v1 = _states(4, 1)
    keys1, _ = layer.update(k1, v1)
    held = keys1.clone()
    buffer = layer._key_buffer
    k2, v2 = _states(6, 2)
    keys2, values2 = layer.update(k2, v2)
    assert layer._key_buffer is buffer and keys2.data_ptr() == buffer.data_ptr()  # no copy of the past
    torch.testing.assert_close(keys1, held, rtol=0, atol=0)
    torch.testing.assert_close(keys2, torch.cat([k1, k2], dim=-2), rtol=0, atol=0)
    torch.testing.assert_close(values2, torch.cat([v1, v2], dim=-2), rtol=0, atol=0)
    assert layer.get_seq_length() == 10 and layer.keys.shape[-2] == 10
    # A buffer filled to the prompt still has its spare slot (a full view would be contiguous, see GrowableLayer).
    assert buffer.shape[-2] == 11


def test_assigned_keys_are_adopted_and_the_next_append_copies_them():
    layer = GrowableLayer(capacity=8)
    k1, v1 = _states(6, 3)
    layer.update(k1, v1)
    layer.crop(-2)  # transformers assigns views of what it had
    assert layer.get_seq_length() == 4
    k2, v2 = _states(3, 4)
    keys, values = layer.update(k2, v2)
    torch.testing.assert_close(keys, torch.cat([k1[:, :, :4], k2], dim=-2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([v1[:, :, :4], v2], dim=-2), rtol=0, atol=0)
    layer.reset()
    assert layer.keys is None and layer.get_seq_length() == 0


def test_states_of_another_dtype_get_a_buffer_of_their_dtype():
    layer = GrowableLayer()
    layer.allocate(16, 1, 2, 4, 4, torch.float32, torch.device("cpu"))
    k, v = _states(3, 5, torch.bfloat16)
    keys, values = layer.update(k, v)
    assert keys.dtype == values.dtype == torch.bfloat16
    torch.testing.assert_close(keys, k, rtol=0, atol=0)


def test_reserve_grows_before_the_forward_and_keeps_the_past():
    layer = GrowableLayer(capacity=4)
    k1, v1 = _states(4, 6)
    layer.update(k1, v1)

    class _Cache:
        layers = [layer]

    reserve(_Cache, 40)
    assert layer._key_buffer.shape[-2] > 40
    torch.testing.assert_close(layer.keys, k1, rtol=0, atol=0)
    buffer = layer._key_buffer
    k2, v2 = _states(36, 7)
    layer.update(k2, v2)
    assert layer._key_buffer is buffer


# ---- compiled, in the engine -------------------------------------------------------------------------------------

def _reference(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), past_key_values=DynamicCache(config=model.config), use_cache=True)
    return out.logits[0, -1].float(), out.past_key_values


@pytest.fixture()
def compiled_llama():
    torch._dynamo.reset()
    model = zoo.build("llama", "sdpa")
    backend = CapturingBackend(ttftc.Config(precision="fp32"))
    # As LLM compiles its KV path (llm.py): dynamic from the first call.
    return model, backend, torch.compile(model, backend=backend, dynamic=True)


def test_compiled_chunked_prefill_writes_kv_in_place_with_eagers_numbers(compiled_llama):
    model, backend, compiled = compiled_llama
    ids = zoo.example_ids(model, 29)[0].tolist()
    expected_logits, expected_kv = _reference(model, ids)
    engine = PrefillEngine(compiled, chunk_size=8)
    dynamo_utils.counters.clear()
    first = engine.first_token(ids)
    assert_logits_match(first.logits, expected_logits)
    layers = first.kv.cache.layers
    assert all(type(layer) is GrowableLayer for layer in layers)
    for layer, (keys, values) in zip(layers, ((la.keys, la.values) for la in expected_kv.layers)):
        torch.testing.assert_close(layer.keys, keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.values, values, rtol=1e-5, atol=1e-5)
        assert layer._key_buffer.shape[-2] == len(ids) + 1  # allocated once, for the prompt: never grown
    # One graph per kind of forward (a cold chunk, a continuing chunk), none broken.
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2
    assert not dynamo_utils.counters["graph_break"]
    report = backend.report()
    # Every K and V append of the continuing-chunk graph is in place; the cold graph's too.
    assert report.pass_counts["kv_inplace"] == 2 * 2 * model.config.num_hidden_layers
    assert not report.rejections.get("kv_inplace")
    assert report.ops_after.get("aten.slice_scatter", 0) == 0
    # No concatenation of KV left (the rotary embedding's cat of its frequencies is 3-D).
    kv_cats = [n for gm in backend.graphs for n in gm.graph.nodes
               if n.op == "call_function" and n.target is aten.cat.default
               and any(a.meta["val"].dim() == 4 for a in n.args[0])]
    assert not kv_cats
    first.kv.release()


def test_decode_continues_from_the_preallocated_cache(compiled_llama):
    model, backend, compiled = compiled_llama
    ids = zoo.example_ids(model, 21)[0].tolist()
    engine = PrefillEngine(compiled, chunk_size=8)
    first = engine.first_token(ids)
    dynamo_utils.counters.clear()
    # Past the prompt's buffer: the engine grows it before each forward, never inside the compiled graph.
    tokens = engine.generate(first, 12)
    with torch.no_grad():
        plain = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert tokens == plain
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1  # the decode graph, once
    assert not dynamo_utils.counters["graph_break"]
    layer = first.kv.cache.layers[0]
    assert layer.get_seq_length() == len(ids) + 11 and layer._key_buffer.shape[-2] > len(ids) + 11
    first.kv.release()


def test_prefix_cache_blocks_taken_from_the_preallocated_cache_serve_a_later_prompt(compiled_llama):
    model, backend, compiled = compiled_llama
    prompt = zoo.example_ids(model, 27)[0].tolist()
    longer = prompt + zoo.example_ids(model, 9, seed=5)[0].tolist()
    engine = PrefillEngine(compiled, prefix_cache=PrefixCache(1 << 24, block_size=8), chunk_size=8)
    cold = engine.first_token(prompt, tenant="t")
    warm = engine.first_token(longer, tenant="t")
    assert warm.cached_tokens == 24
    assert_logits_match(cold.logits, _reference(model, prompt)[0])
    expected_logits, expected_kv = _reference(model, longer)
    assert_logits_match(warm.logits, expected_logits)
    for layer, expected in zip(warm.kv.cache.layers, expected_kv.layers):
        torch.testing.assert_close(layer.keys, expected.keys, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        plain = model.generate(torch.tensor([longer]), max_new_tokens=4, do_sample=False)[0, len(longer):].tolist()
    assert engine.generate(warm, 4) == plain
    cold.kv.release()
    warm.kv.release()


def test_new_cache_preallocates_for_compiled_models(compiled_llama):
    model, _, compiled = compiled_llama
    cache = new_cache(compiled, 12)
    assert len(cache.layers) == model.config.num_hidden_layers
    for layer in cache.layers:
        assert type(layer) is GrowableLayer and layer._key_buffer.shape[-2] == 13 and layer.get_seq_length() == 0
