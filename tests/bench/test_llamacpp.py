"""llama.cpp as a bench peer: the GGUF conversion, the prefill call, and the skip without the extra."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ttftc import zoo
from ttftc.bench import BenchSettings, llamacpp, run_bench
from ttftc.bench.errors import BenchInputError
from ttftc.bench.variants import DEFAULT_VARIANTS, VARIANTS

QUICK = dict(repeats=2, warmup=1, peak_size=256, progress=False, first_call="in-process")
needs_extra = pytest.mark.skipif(llamacpp.missing_reason() is not None,
                                 reason=f"llama.cpp extra absent: {llamacpp.missing_reason()}")


def test_rotary_rows_move_from_half_split_to_interleaved_pairs():
    heads, head_dim, columns = 3, 8, 5
    weight = torch.arange(heads * head_dim * columns, dtype=torch.float32).reshape(heads * head_dim, columns).numpy()
    moved = llamacpp.interleave_rotary_rows(weight, heads)
    for h in range(heads):
        for i in range(head_dim // 2):
            base = h * head_dim
            assert (moved[base + 2 * i] == weight[base + i]).all()
            assert (moved[base + 2 * i + 1] == weight[base + i + head_dim // 2]).all()


def test_without_the_extra_the_variants_are_skipped_with_the_install_line(monkeypatch):
    installed = {"gguf"}  # whatever this machine has: only the stand-in's answer counts
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec",
                        lambda name: (object() if name in installed else None) if name in ("llama_cpp", "gguf")
                        else real_find_spec(name))
    assert llamacpp.missing_reason() == 'llama-cpp-python not installed: pip install -e ".[llamacpp]"'
    installed.clear()
    assert llamacpp.missing_reason() == 'llama-cpp-python and gguf not installed: pip install -e ".[llamacpp]"'
    installed.add("gguf")
    doc = run_bench(BenchSettings(model="tiny", seqs=(8,), variants=("llamacpp-q8_0", "eager-sdpa"), **QUICK))
    rows = {r["variant"]: r for r in doc["results"]}
    assert rows["llamacpp-q8_0"]["status"] == 'skipped: llama-cpp-python not installed: pip install -e ".[llamacpp]"'
    assert rows["eager-sdpa"]["status"] == "ok"


def test_the_peers_are_asked_for_by_name_and_bounded_by_their_precision():
    assert {VARIANTS[f"llamacpp-{t}"].dtype for t in llamacpp.FILE_TYPES} == {"fp32", "bf16", "int8"}
    assert not any(name.startswith("llamacpp-") for name in DEFAULT_VARIANTS)


def test_only_bias_free_llama_models_convert():
    with pytest.raises(BenchInputError, match="Llama-family models only.*'qwen2'"):
        llamacpp.LlamaShape.of(zoo.build("qwen2"))
    with pytest.raises(BenchInputError, match="without biases"):
        llamacpp.LlamaShape.of(zoo.build("llama", attention_bias=True))
    shape = llamacpp.LlamaShape.of(zoo.build("llama", num_key_value_heads=2))
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (4, 2, 16)


@needs_extra
@pytest.mark.parametrize("file_type, atol, min_cosine", [("f32", 2e-3, 0.99999), ("bf16", 2e-2, 0.9999),
                                                         ("q8_0", 5e-2, 0.999)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_llamacpp_gives_the_models_last_logits(file_type, atol, min_cosine, kv_heads):
    model = zoo.build("llama", attn="sdpa", num_key_value_heads=kv_heads, vocab_size=512)
    ids = zoo.example_ids(model, 40)
    with torch.inference_mode():
        expected = model(input_ids=ids, logits_to_keep=1).logits
    loaded = llamacpp.load(model, file_type, threads=1)
    first = loaded(input_ids=ids, logits_to_keep=1, use_cache=True).logits
    assert first.shape == expected.shape
    torch.testing.assert_close(first, expected, atol=atol, rtol=0)
    assert torch.nn.functional.cosine_similarity(first.flatten(), expected.flatten(), dim=0) >= min_cosine
    # A second prompt starts from an empty KV cache: the same prompt gives the same logits, a longer one differs.
    assert torch.equal(loaded(input_ids=ids).logits, first)
    assert not torch.equal(loaded(input_ids=zoo.example_ids(model, 41)).logits, first)


@needs_extra
def test_llamacpp_refuses_what_it_does_not_run():
    model = zoo.build("llama", vocab_size=512)  # max_position_embeddings 512: the llama.cpp context
    loaded = llamacpp.load(model, "f32", threads=1)
    ids = zoo.example_ids(model, 8)
    with pytest.raises(BenchInputError, match="plain prefill only"):
        loaded(input_ids=ids, logits_to_keep=0)
    with pytest.raises(BenchInputError, match="plain prefill only"):
        loaded(input_ids=ids, attention_mask=torch.ones_like(ids))
    with pytest.raises(BenchInputError, match="batch-1"):
        loaded(input_ids=ids.repeat(2, 1))
    with pytest.raises(BenchInputError, match="exceeds the llama.cpp context"):
        loaded(input_ids=torch.zeros(1, 513, dtype=torch.long))


@needs_extra
def test_a_bench_run_times_llamacpp_beside_eager():
    doc = run_bench(BenchSettings(model="tiny", seqs=(16,), variants=("llamacpp-f32", "eager-sdpa"), **QUICK))
    rows = {r["variant"]: r for r in doc["results"]}
    assert rows["llamacpp-f32"]["status"] == "ok" and rows["llamacpp-f32"]["ttft_ms_p50"] > 0
    assert rows["eager-sdpa"]["status"] == "ok"
