"""What the serve tests share: a tiny model directory with a real tokenizer, bounded polling, and a look at the
requests an LLM queues."""

from __future__ import annotations

import time
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} \n{% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def tiny_model_dir(directory: Path) -> Path:
    """The `tiny` preset saved with a word-level tokenizer (one word per id, so every generated id decodes) and a
    chat template: a model directory as a user would serve it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ttftc import zoo

    model = zoo.build_preset("tiny")
    specials = ["<unk>", "<s>", "</s>", "user", "assistant", "system", ":"]
    words = specials + [f"w{i}" for i in range(model.config.vocab_size - len(specials))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    model.config.eos_token_id = 2
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


def wait_until(condition, timeout_s: float = 20.0, what: str = "condition"):
    """Poll `condition` until it returns something truthy, for at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def submitted_priorities(monkeypatch, llm) -> list:
    """The priority of each request `llm` queues from now on (until the test ends), in order."""
    priorities: list = []
    submit = llm._loop.submit

    def spy(request, *args, **kwargs):
        priorities.append(request.priority)
        return submit(request, *args, **kwargs)

    monkeypatch.setattr(llm._loop, "submit", spy)
    return priorities
