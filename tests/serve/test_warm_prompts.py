"""`--warm-prompts`: prompts prefilled and pinned before the server is up, hit by the first request of their tenant
(the real `openai` client against a real server), kept through LRU pressure, reported in /metrics; and a bad file
refused with file:line for each bad line, with nothing pinned."""

from __future__ import annotations

import json
import os
import urllib.request

import openai
import pytest

import ttftc
from ttftc.cli import main
from ttftc.serve import BackgroundServer, create_app
from ttftc.serve import warm as warm_module
from ttftc.serve.warm import WarmPrompt, WarmPromptsError, read_warm_prompts, warm_prompts
from tests.serve.helpers import metric

TIMEOUT_S = 60
SYSTEM = [(11 * i + 5) % 500 for i in range(40)]  # a system prompt: 2 full blocks of 16, and 8 tokens


@pytest.fixture(scope="module")
def llm():
    llm = ttftc.LLM("tiny", precision="fp32", buckets=None, compile_kv_path=False)
    yield llm
    llm.close(drain_timeout_s=5)


def write_lines(path, lines) -> str:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_a_warm_prompt_is_hit_by_its_tenants_first_request_and_shown_in_metrics(llm, tmp_path):
    path = write_lines(tmp_path / "warm.jsonl", [{"prompt": SYSTEM, "tenant": "acme"}, "",
                                                 {"prompt": SYSTEM[:20] + [1] * 20, "tenant": "acme"}])
    app = create_app(llm, tenant_header="X-Tenant", warm=read_warm_prompts(path))
    try:
        with BackgroundServer(app) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)

            def cached(tenant):
                response = client.completions.create(model="tiny", prompt=SYSTEM + [7, 8, 9], max_tokens=1,
                                                     temperature=0, extra_headers={"X-Tenant": tenant})
                return response.usage.prompt_tokens_details.cached_tokens

            assert cached("acme") == 32, "the very first request of the tenant is served from the warm prompt"
            assert cached("other") == 0, "another tenant does not see it"
            with urllib.request.urlopen(server.url + "/metrics", timeout=TIMEOUT_S) as response:
                text = response.read().decode()
            # Two prompts; their blocks: SYSTEM's 2, and the second's 2 (its first block is SYSTEM's first).
            assert metric(text, "ttftc_prefix_cache_pinned_prompts") == 2
            assert metric(text, "ttftc_prefix_cache_pinned_tokens") == 16 * 3
    finally:
        app.state.served.warmed.unpin(llm)
    assert llm._prefix_cache.stats().pinned_blocks == 0


def test_a_warm_prompt_outlives_lru_pressure(llm):
    block = llm._prefix_cache.block_bytes
    llm = ttftc.LLM("tiny", precision="fp32", buckets=None, compile_kv_path=False, prefix_cache_bytes=6 * block,
                    warmup=False)
    try:
        warmed = warm_prompts(llm, [WarmPrompt(tuple(SYSTEM), "acme")], require_tenant=True)
        for k in range(8):  # traffic of 8 x 4 blocks through a cache of 6: everything else is evicted
            llm.generate([[(k * 31 + i) % 500 for i in range(65)]], max_new_tokens=1, tenant="acme")
        assert llm._prefix_cache.stats().evicted_blocks > 0
        (again,) = llm.generate([SYSTEM + [3]], max_new_tokens=1, tenant="acme")
        assert again.cached_tokens == 32
        warmed.unpin(llm)
    finally:
        llm.close()


def test_pins_that_alone_exceed_the_cache_are_refused_at_startup_with_nothing_pinned(llm):
    block = llm._prefix_cache.block_bytes
    llm = ttftc.LLM("tiny", precision="fp32", buckets=None, compile_kv_path=False, prefix_cache_bytes=3 * block,
                    warmup=False)
    try:
        prompts = [WarmPrompt(tuple(SYSTEM), "acme", "f:1"), WarmPrompt(tuple(SYSTEM), "beta", "f:2")]  # 4 blocks
        with pytest.raises(WarmPromptsError, match=r"pin 4 cache blocks .* more than the prefix cache's budget"):
            create_app(llm, tenant_header="X-Tenant", warm=prompts)
        stats = llm._prefix_cache.stats()
        assert stats.pinned_blocks == 0 and stats.blocks_held == 0, "refused before anything was prefilled"
    finally:
        llm.close()


def test_a_prompt_that_cannot_be_served_is_refused_with_its_line_and_nothing_pinned(llm, tmp_path):
    prompts = [WarmPrompt(tuple(SYSTEM), "acme", "w.jsonl:1"), WarmPrompt("hello there", "acme", "w.jsonl:2"),
               WarmPrompt((1, 2, 3), "acme", "w.jsonl:3"), WarmPrompt((1,) * 20 + (512,), "acme", "w.jsonl:4"),
               WarmPrompt(tuple(SYSTEM), None, "w.jsonl:5")]
    with pytest.raises(WarmPromptsError) as refused:
        create_app(llm, tenant_header="X-Tenant", warm=prompts)
    message = str(refused.value)
    assert "w.jsonl:1" not in message
    assert "w.jsonl:2: " in message and "tokenizer" in message
    assert "w.jsonl:3: 3 tokens, less than one prefix-cache block" in message
    assert "w.jsonl:4: token id 512 is outside the vocabulary" in message
    assert "w.jsonl:5: no tenant" in message
    assert llm._prefix_cache.stats().pinned_blocks == 0
    with pytest.raises(ValueError, match="warm prompts need a tenant header"):
        create_app(llm, warm=prompts[:1])


def test_a_bad_file_names_each_bad_line(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [
        {"prompt": [1, 2, 3], "tenant": "acme"},
        "{not json",
        "[1, 2]",
        {"prompt": [1, True], "tenant": "acme"},
        {"prompt": "", "tenant": "acme"},
        {"prompt": [1], "tenant": ""},
        {"prompt": [1], "tenant": "acme", "priority": 3},
        "",
        {"prompt": 5},
        "[" * 100_000 + "]" * 100_000,
    ])
    with pytest.raises(WarmPromptsError) as refused:
        read_warm_prompts(path)
    lines = str(refused.value).splitlines()
    assert [line.split(": ")[0] for line in lines] == [f"{path}:{n}" for n in (2, 3, 4, 5, 6, 7, 9, 10)]
    assert "not a JSON object" in lines[0] and "a JSON list" in lines[1] and "integer token ids" in lines[2]
    assert "empty" in lines[3] and "tenant must be a non-empty string" in lines[4]
    assert "unknown field 'priority'" in lines[5]
    good = write_lines(tmp_path / "good.jsonl", [{"prompt": [1, 2, 3], "tenant": "acme"}, "",
                                                 {"prompt": "text", "tenant": None}])
    assert read_warm_prompts(good) == [WarmPrompt((1, 2, 3), "acme", f"{good}:1"),
                                       WarmPrompt("text", None, f"{good}:3")]


def test_the_file_is_read_within_its_caps_and_only_as_a_regular_file(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_module, "MAX_LINE_CHARS", 64)
    monkeypatch.setattr(warm_module, "MAX_PROMPTS", 2)
    path = write_lines(tmp_path / "caps.jsonl", [{"prompt": list(range(40)), "tenant": "a"},
                                                 {"prompt": [1], "tenant": "a"}, {"prompt": [2], "tenant": "a"},
                                                 {"prompt": [3], "tenant": "a"}])
    with pytest.raises(WarmPromptsError) as refused:
        read_warm_prompts(path)
    assert str(refused.value).splitlines() == [
        f"{path}:1: a line of {len(json.dumps({'prompt': list(range(40)), 'tenant': 'a'}))} characters; at most 64 "
        "are read", f"{path}:4: more than 2 prompts; warm the most used ones only"]
    (tmp_path / "binary.jsonl").write_bytes(b'{"prompt": [1], "tenant": "a"}\n\xff\xfe\n')
    with pytest.raises(WarmPromptsError, match=r"binary.jsonl:2: not UTF-8"):
        read_warm_prompts(tmp_path / "binary.jsonl")
    os.symlink(path, tmp_path / "link.jsonl")
    with pytest.raises(WarmPromptsError, match="regular file"):
        read_warm_prompts(tmp_path / "link.jsonl")
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(WarmPromptsError, match="regular file"):
        read_warm_prompts(tmp_path / "fifo.jsonl")
    with pytest.raises(WarmPromptsError, match="no such file"):
        read_warm_prompts(tmp_path / "missing.jsonl")


def test_serve_refuses_a_bad_warm_prompts_file_with_its_line_before_loading_the_model(tmp_path, capsys):
    path = write_lines(tmp_path / "w.jsonl", [{"prompt": [1, 2], "tenant": "a"}, {"prompt": [1], "tenant": 7}])
    assert main(["serve", "tiny", "--tenant-header", "X-Tenant", "--warm-prompts", path]) == 2
    assert f"{path}:2: tenant must be a non-empty string" in capsys.readouterr().err
    assert main(["serve", "tiny", "--warm-prompts", path]) == 2
    assert "--warm-prompts needs --tenant-header" in capsys.readouterr().err
