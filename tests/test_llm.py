"""`ttftc.LLM`: generate and stream on the engine thread, tenants, results, early exit, bad arguments, artifacts."""

from __future__ import annotations

import re
import threading

import pytest
import torch

import ttftc
from ttftc import zoo
from ttftc.llm import ServingConfig
from ttftc.runtime import PRIVATE, EngineClosedError, PrefixCache, background
from tests.serve.helpers import submitted_priorities, wait_until

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def llm():
    model = ttftc.LLM("tiny", buckets=None, precision="fp32", chunked_prefill=16, compile_kv_path=False,
                      prompt_cache=PrefixCache(1 << 24, block_size=8))
    yield model
    model.close(drain_timeout_s=5)


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_generate_matches_the_models_own_greedy_decode(llm):
    prompts = [ids(5, 1), ids(40, 2)]
    results = llm.generate(prompts, max_new_tokens=6, ignore_eos=True, timeout_s=TIMEOUT_S)
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            plain = llm._model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                       eos_token_id=None)[0, len(prompt):].tolist()
        assert result.token_ids == plain and result.finish_reason == "length"
        assert result.prompt_tokens == len(prompt) and result.ttft_s > 0 and result.queue_s >= 0
        assert len(result.token_times) == 6 and result.text == "".join(f"<{t}>" for t in plain)
    (single,) = llm.generate(prompts[0], max_new_tokens=6, ignore_eos=True)  # one prompt, not a list of them
    assert single.token_ids == results[0].token_ids


def test_calls_without_a_tenant_share_the_llms_namespace_and_a_tenant_isolates(llm):
    prompt = ids(33, 3)
    assert [llm.generate(prompt)[0].cached_tokens for _ in range(2)] == [0, 32]
    assert [llm.generate(prompt, tenant=PRIVATE)[0].cached_tokens for _ in range(2)] == [0, 0]
    first, second = (llm.generate(prompt, tenant="acme")[0] for _ in range(2))
    assert (first.cached_tokens, second.cached_tokens) == (0, 32)
    assert llm.generate(prompt, tenant="zeta")[0].cached_tokens == 0
    with pytest.raises(ValueError, match="tenant must be a string"):
        llm.generate(prompt, tenant=7)


def test_the_issue_snippet_reuses_a_system_prompt_without_a_tenant():
    """Issue 32's snippet, as a new user writes it: the second call reuses the 192 tokens of full blocks."""
    llm = ttftc.LLM("tiny", precision="fp32", buckets=None, compile_kv_path=False, warmup=False)
    try:
        system = list(range(1, 200))
        cached = [llm.generate([system + tail])[0].cached_tokens for tail in ([5, 6], [7, 8])]
        assert cached == [0, 192]
        assert llm.generate([system + [9, 9]], tenant="me")[0].cached_tokens == 0
    finally:
        llm.close()


def test_the_llms_own_namespace_can_be_named_and_is_not_anyone_elses():
    llm = ttftc.LLM("tiny", precision="fp32", buckets=None, compile_kv_path=False, warmup=False, tenant="app")
    try:
        prompt = ids(33, 4)
        assert llm.generate(prompt)[0].cached_tokens == 0
        assert llm.generate(prompt, tenant="app")[0].cached_tokens == 32, "tenant= names the default namespace"
        assert llm.generate(prompt, tenant="other")[0].cached_tokens == 0
        assert llm._engine.prefix_cache.cached_tokens(prompt, tenant=None) == 0, "the unnamed tree stays empty"
    finally:
        llm.close()
    with pytest.raises(ValueError, match="tenant must be a string"):
        ttftc.LLM("tiny", buckets=None, warmup=False, compile_kv_path=False, tenant=3)


def test_a_config_and_a_prefix_cache_of_your_own(tmp_path):
    """The main form, LLM(model, ServingConfig(...)), with a PrefixCache given beside the config; a disk tier is
    for the cache LLM builds, so asking for one with your own cache is refused."""
    cache = PrefixCache(1 << 24, block_size=8)
    config = ServingConfig(precision="fp32", buckets=None, compile_kv_path=False, warmup=False, max_running=2)
    llm = ttftc.LLM("tiny", config, prefix_cache=cache)
    try:
        assert llm.config is config and llm._scheduler.max_running == 2
        prompt = ids(17, 6)
        assert [llm.generate(prompt)[0].cached_tokens for _ in range(2)] == [0, 16]
        assert cache.stats().blocks_held == 2 and llm.stats()["prefix_cache"] == cache.stats()
    finally:
        llm.close(5)
    with pytest.raises(ValueError, match="give a PrefixCache of your own its disk="):
        ttftc.LLM("tiny", ServingConfig(buckets=(32,), kv_disk=tmp_path), prefix_cache=PrefixCache(1 << 24))


def test_stream_yields_as_it_goes_and_leaving_early_cancels(llm):
    stream = llm.stream(ids(10, 4), max_new_tokens=5, ignore_eos=True, timeout_s=TIMEOUT_S)
    deltas = list(stream)
    assert [d.token_ids[0] for d in deltas] == stream.completion.token_ids and len(deltas) == 5
    endless = llm.stream(ids(10, 5), max_new_tokens=3000, ignore_eos=True, timeout_s=TIMEOUT_S)
    for n, _ in enumerate(endless):
        if n == 2:
            break
    wait_until(lambda: llm.stats()["running"] == 0 and llm.stats()["kv_tokens"] == 0, what="the cancel")


def test_priority_reaches_the_scheduler_from_generate_and_stream(llm, monkeypatch):
    submitted = submitted_priorities(monkeypatch, llm)
    (low,) = llm.generate([ids(6, 3)], max_new_tokens=3, ignore_eos=True, priority=7, timeout_s=TIMEOUT_S)
    streamed = [t for delta in llm.stream(ids(6, 3), max_new_tokens=3, ignore_eos=True, priority=-2,
                                          timeout_s=TIMEOUT_S) for t in delta.token_ids]
    (default,) = llm.generate([ids(6, 3)], max_new_tokens=3, ignore_eos=True, timeout_s=TIMEOUT_S)
    assert submitted == [7, -2, 0]
    assert low.token_ids == streamed == default.token_ids  # priority decides when, never what


def test_bad_input_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("a text prompt")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([1, 512])
    with pytest.raises(ValueError, match="maximum context length is 4096"):
        llm.generate(ids(4090), max_new_tokens=10)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(ids(4), temperature=-0.5)
    with pytest.raises(ValueError, match="priority must be an integer from -2147483648 to 2147483647"):
        llm.generate(ids(4), priority=2**31)
    with pytest.raises(ValueError, match="chunked_prefill"):
        ttftc.LLM("tiny", buckets=None, chunked_prefill=0)
    with pytest.raises(ValueError, match="yield_chunk must be a positive int"):
        ttftc.LLM("tiny", buckets=None, yield_chunk=0)
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        ttftc.LLM("nope")


def test_close_drains_then_refuses_new_work():
    llm = ttftc.LLM(zoo.build("llama"), buckets=None, precision="fp32", compile_kv_path=False)
    stream = llm.stream([1, 2, 3, 4, 5, 6], max_new_tokens=500, ignore_eos=True, timeout_s=TIMEOUT_S)
    tokens = iter(stream)  # held: a dropped iterator cancels its request
    next(tokens)
    assert llm.close(drain_timeout_s=0.01) == 1  # a long stream is cut off at the drain timeout
    with pytest.raises(EngineClosedError):
        llm.generate([1, 2, 3])


def test_an_artifact_serves_prefill_and_its_recorded_model_decodes(tmp_path):
    from ttftc.aot.build import build_artifact

    directory = build_artifact("tiny", tmp_path / "artifact", ttftc.Config(buckets=(32,)), batch_sizes=(1,))
    eager = ttftc.LLM("tiny", buckets=None, precision="fp32", prompt_cache=False, compile_kv_path=False)
    served = ttftc.LLM(str(directory), precision="fp32", prompt_cache=False, compile_kv_path=False)
    try:
        assert served._engine.prefill_model is not None and served.name == "artifact"
        prompt = ids(20, 7)
        (a,) = served.generate(prompt, max_new_tokens=6, ignore_eos=True, timeout_s=TIMEOUT_S)
        (b,) = eager.generate(prompt, max_new_tokens=6, ignore_eos=True, timeout_s=TIMEOUT_S)
        assert a.token_ids == b.token_ids
    finally:
        served.close(5)
        eager.close(5)


def test_the_compiled_kv_path_decodes_and_continues_like_the_eager_model():
    llm = ttftc.LLM("tiny", buckets=None, precision="fp32", chunked_prefill=16)  # compile_kv_path=True: default
    try:
        prompts = [ids(1, 8), ids(40, 9)]  # a one-token prompt; a prompt in three chunks
        results = llm.generate(prompts, max_new_tokens=5, ignore_eos=True, tenant="t", timeout_s=TIMEOUT_S)
        (warm,) = llm.generate(prompts[1], max_new_tokens=5, ignore_eos=True, tenant="t", timeout_s=TIMEOUT_S)
        assert warm.cached_tokens == 32 and warm.token_ids == results[1].token_ids  # continued from cached KV
        for prompt, result in zip(prompts, results):
            with torch.no_grad():
                plain = llm._model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                                           eos_token_id=None)[0, len(prompt):].tolist()
            assert result.token_ids == plain
    finally:
        llm.close(5)


def test_background_compile_serves_eagerly_then_swaps_the_compiled_kv_path_in(monkeypatch, tmp_path):
    # A compile cache of its own: in a shared one, an earlier test's KV graphs would be loaded, not compiled.
    monkeypatch.setenv("TTFTC_COMPILE_CACHE", str(tmp_path / "compile"))
    gate = threading.Event()
    warm = background.warm_kv_path

    def held(engine, stop):
        assert gate.wait(TIMEOUT_S * 2), "the test never let the KV path compile"
        return warm(engine, stop)

    monkeypatch.setattr(background, "warm_kv_path", held)
    lines: list[str] = []
    llm = ttftc.LLM("tiny", buckets=None, precision="fp32", chunked_prefill=16, background_compile=True,
                    on_progress=lines.append)
    try:
        eager = llm._model
        assert llm._engine.model is eager and llm.compile_status()["kv_path"] == "pending"
        prompts = [ids(1, 8), ids(40, 9)]
        before = llm.generate(prompts, max_new_tokens=5, ignore_eos=True, timeout_s=TIMEOUT_S)
        assert llm._engine.model is eager, "served on the eager model while the KV path compiles"
        gate.set()
        assert llm._compiler.done.wait(TIMEOUT_S * 4)
        status = llm.compile_status()
        assert status.pop("graphs_compiled") >= 1, "the KV path's graphs are counted as compiled"
        assert status == {"buckets_total": 0, "buckets_compiled": 0, "buckets_failed": 0, "buckets_compiling": 0,
                          "kv_path": "compiled", "background": True, "warm": True, "graphs_loaded": 0}
        compiled = llm._engine.model
        assert compiled is not eager and isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
        assert len(lines) == 1 and lines[0].startswith("KV path compiled in "), lines
        after = llm.generate(prompts, max_new_tokens=5, ignore_eos=True, timeout_s=TIMEOUT_S)
        assert [r.token_ids for r in after] == [r.token_ids for r in before]
    finally:
        gate.set()
        llm.close(5)


def test_a_failed_background_kv_compile_keeps_the_eager_model(monkeypatch):
    def broken(engine, stop):
        raise RuntimeError("simulated Dynamo failure")

    monkeypatch.setattr(background, "warm_kv_path", broken)
    llm = ttftc.LLM("tiny", buckets=None, precision="fp32", background_compile=True)
    try:
        assert llm._compiler.done.wait(TIMEOUT_S)
        assert llm._engine.model is llm._model and llm.compile_status()["kv_path"] == "failed"
        assert any("simulated Dynamo failure" in note for note in llm.notes), llm.notes
        (result,) = llm.generate([ids(12, 3)], max_new_tokens=3, ignore_eos=True, timeout_s=TIMEOUT_S)
        assert len(result.token_ids) == 3
    finally:
        llm.close(5)


def test_the_python_api_compiles_before_it_returns_by_default():
    lines: list[str] = []
    llm = ttftc.LLM("tiny", buckets=(16,), precision="fp32", prefill_batch_sizes=(1,), compile_kv_path=False,
                    on_progress=lines.append)
    try:
        assert llm._compiler is None and llm._engine.ready_batches is None and llm._engine.prefill_model is not None
        assert re.match(r"bucket 16 (compiled|loaded) in ", lines[0]), lines
        assert lines[-1].startswith("KV path warmed up (eager) in ")
        assert llm.compile_status()["warm"]
        assert llm.compile_status()["buckets_compiled"] == 1 and llm.compile_status()["buckets_compiling"] == 0
    finally:
        llm.close(5)


def test_close_during_the_background_kv_compile_stops_it_at_its_next_forward(monkeypatch):
    gate, entered, forwards = threading.Event(), threading.Event(), []
    warm = background.warm_kv_path

    def held(engine, stop):
        entered.set()
        assert gate.wait(TIMEOUT_S * 2), "the test never let the KV path compile"
        return warm(engine, lambda: forwards.append(stop()) or stop())

    monkeypatch.setattr(background, "warm_kv_path", held)
    llm = ttftc.LLM("tiny", buckets=None, precision="fp32", background_compile=True)
    assert entered.wait(TIMEOUT_S), "the KV path's compile started"
    closer = threading.Thread(target=llm.close, kwargs={"drain_timeout_s": 0})
    with pytest.warns(UserWarning, match="waiting for the background compile") as record:
        closer.start()
        wait_until(lambda: len(record), TIMEOUT_S, "close to wait for the compile")
        gate.set()
        closer.join(TIMEOUT_S)
    assert not closer.is_alive() and llm._compiler.done.is_set()
    assert forwards == [True], "no KV-path forward (no compile) ran after close"
    assert llm._engine.model is llm._model and llm.compile_status()["kv_path"] == "pending"
    assert not llm.compile_status()["warm"], "stopped before the KV path was ready"
