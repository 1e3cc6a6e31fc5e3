"""A model directory with a tokenizer: text prompts, the chat template, stop strings, over HTTP and in `LLM`."""

from __future__ import annotations

import openai
import pytest

import ttftc
from ttftc.serve import BackgroundServer, create_app
from tests.serve.helpers import tiny_model_dir

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tiny_model_dir(tmp_path_factory.mktemp("tiny-with-tokenizer"))
    llm = ttftc.LLM(str(directory), buckets=None, precision="fp32", compile_kv_path=False)
    server = BackgroundServer(create_app(llm)).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=TIMEOUT_S)
    yield llm, client
    server.stop()
    llm.close(drain_timeout_s=5)


def test_a_text_prompt_streams_text_that_equals_generate(served):
    llm, client = served
    text = "w1 w2 w3 w4 w5"
    chunks = list(client.completions.create(model=llm.name, prompt=text, max_tokens=6, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    (expected,) = llm.generate(text, max_new_tokens=6, ignore_eos=True)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert expected.text.split() == [llm.tokenizer.decode([t]) for t in expected.token_ids]
    assert llm.encode(text) == [llm.tokenizer.convert_tokens_to_ids(w) for w in text.split()]


def test_chat_uses_the_tokenizers_template_and_streams_role_with_the_first_token(served):
    llm, client = served
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": [{"type": "text", "text": "w7 w8"}]}]
    chunks = list(client.chat.completions.create(model=llm.name, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.model_extra["token_ids"], "role and first token together"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = llm.encode("system : w9 user : w7 w8 assistant :")
    (expected,) = llm.generate([ids], max_new_tokens=5, ignore_eos=True)
    assert content == expected.text
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 5
    whole = client.chat.completions.create(model=llm.name, messages=messages, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == expected.text and whole.object == "chat.completion"


def test_a_stop_string_ends_the_output_before_it(served):
    llm, client = served
    (free,) = llm.generate("w10 w11", max_new_tokens=8, ignore_eos=True)
    words = free.text.split()
    stop = words[2]
    cut = free.text.index(stop)
    (stopped,) = llm.generate("w10 w11", max_new_tokens=8, ignore_eos=True, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == free.text[:cut]
    chunks = list(client.completions.create(model=llm.name, prompt="w10 w11", max_tokens=8, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == free.text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_repeats(served):
    llm, client = served
    a, b = (client.completions.create(model=llm.name, prompt="w3 w4", max_tokens=6, temperature=0.9, seed=11,
                                      extra_body={"ignore_eos": True}).choices[0].text for _ in range(2))
    assert a == b and len(a.split()) == 6
