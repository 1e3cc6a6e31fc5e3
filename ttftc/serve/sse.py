"""OpenAI's response objects, streamed as server-sent events (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`) or
returned whole.

Every choice also carries `token_ids` (the ids behind its text, as vLLM's `return_token_ids` does): a model
without a tokenizer has no other honest way to say what it produced, and clients that do not know the field
ignore it. A chat stream's first chunk holds the role and the first token together, so the first byte of the
body is the first token: time to first byte is time to first token.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from ttftc.llm import Completion

DONE = b"data: [DONE]\n\n"
# finish reasons of ttftc.LLM that OpenAI's schema has no word for
_OPENAI_FINISH = {"cancelled": "abort", "error": "abort"}


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class ResponseShape:
    """The fields every chunk of one response shares."""

    kind: str  # "completion" or "chat"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    report_cached_tokens: bool = True  # False: usage says 0 cached tokens (see ttftc/serve/app.py)
    _role_sent: bool = False

    def __post_init__(self):
        if not self.id:
            self.id = ("cmpl-" if self.kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]

    def _envelope(self, choices: list, *, chunk: bool) -> dict:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, text: str, token_ids: list[int], finish_reason: Optional[str] = None) -> dict:
        choice: dict = {"index": 0}
        if self.kind == "completion":
            choice["text"] = text
        else:
            delta: dict = {}
            if not self._role_sent:
                delta["role"] = "assistant"
                self._role_sent = True
            if text or finish_reason is None:
                delta["content"] = text
            choice["delta"] = delta
        choice.update({"logprobs": None, "finish_reason": _finish(finish_reason), "token_ids": token_ids})
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, completion: Completion) -> dict:
        payload = self._envelope([], chunk=True)
        payload["usage"] = usage(completion, self.report_cached_tokens)
        return payload

    def whole(self, completion: Completion) -> dict:
        choice: dict = {"index": 0}
        if self.kind == "completion":
            choice["text"] = completion.text
        else:
            choice["message"] = {"role": "assistant", "content": completion.text}
        choice.update({"logprobs": None, "finish_reason": _finish(completion.finish_reason),
                       "token_ids": completion.token_ids})
        payload = self._envelope([choice], chunk=False)
        payload["usage"] = usage(completion, self.report_cached_tokens)
        return payload


def usage(completion: Completion, report_cached_tokens: bool = True) -> dict:
    generated = len(completion.token_ids)
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": generated,
            "total_tokens": completion.prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": completion.cached_tokens if report_cached_tokens else 0}}


def _finish(reason: Optional[str]) -> Optional[str]:
    return None if reason is None else _OPENAI_FINISH.get(reason, reason)
