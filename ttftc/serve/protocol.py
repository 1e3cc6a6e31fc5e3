"""OpenAI request bodies to typed requests, with a 400 naming the field for anything the server cannot honour.

Supported: `/v1/completions` with one prompt (a string or a list of token ids) and `/v1/chat/completions` with
text messages; `max_tokens` (chat also `max_completion_tokens`), `temperature`, `top_p`, `seed`, `stop` (at most
4 strings of at most 256 characters), `stream`, `stream_options.include_usage`, and vLLM's extensions `top_k`,
`ignore_eos`, `stop_token_ids` and `priority` (lower is prefilled sooner). Numeric fields are checked against
their ranges before anything is queued (a 400 naming the field): a seed torch cannot take would otherwise fail in
the engine, in a prefill shared with other requests. Parameters OpenAI defines that change the output in ways
this server does not implement (n > 1, logprobs, echo, penalties, logit_bias, tools, ...) are refused unless they
hold their neutral value, rather than silently ignored. Fields OpenAI does not define are refused too: a typo
should not pass for a default.

Types are JSON's, strictly: an integer field takes only an integer (`n: true`, `max_tokens: 1.0` and `priority:
"1"` each get a 400 naming the field), a boolean field only true or false. Python would read true as 1 and 1.0 as
1; a client that sends them has a bug worth hearing about. Values quoted back in a message are shortened
(errors.echo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from ttftc.llm import GenerationParams, ParamError, checked_priority
from ttftc.serve.errors import bad_request, echo, shorten

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # OpenAI's chat default is "up to the context"; a random-weight preset would ramble
MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256

# Accepted and ignored: they do not change what is generated.
_IGNORED = {"user", "metadata", "store", "service_tier"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
           "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "ignore_eos", "stop_token_ids",
           "priority"} | _IGNORED
_COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "echo", "logprobs", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                          "response_format", "parallel_tool_calls"}
# Fields whose only supported value is the neutral one.
_NEUTRAL = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None,),
            "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
            "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
            "parallel_tool_calls": (None, False, True), "top_logprobs": (None, 0)}


@dataclass(frozen=True)
class GenerationRequest:
    kind: str  # "completion" or "chat"
    model: str
    prompt: Union[str, list[int], None]  # completions
    messages: Optional[list[dict]]  # chat
    params: GenerationParams
    stream: bool
    include_usage: bool
    priority: Optional[int] = None  # None: the request named none (the tenant's default, else 0, applies)


def parse_completion(body: Any) -> GenerationRequest:
    body = _object(body)
    _check_fields(body, _COMPLETION_FIELDS)
    if not _neutral(body.get("logprobs"), (None, 0)):
        raise bad_request("logprobs are not supported by this server; omit the field", param="logprobs")
    prompt = _prompt(body.get("prompt"))
    params = _params(body, body.get("max_tokens"), COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
    stream, include_usage = _stream(body)
    return GenerationRequest("completion", _model(body), prompt, None, params, stream, include_usage,
                             _priority(body))


def parse_chat(body: Any) -> GenerationRequest:
    body = _object(body)
    _check_fields(body, _CHAT_FIELDS)
    if not _neutral(body.get("logprobs"), (None, False)):
        raise bad_request("logprobs are not supported by this server; omit the field", param="logprobs")
    messages = _messages(body.get("messages"))
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = _params(body, body.get(limit_name), CHAT_DEFAULT_MAX_TOKENS, limit_name)
    stream, include_usage = _stream(body)
    return GenerationRequest("chat", _model(body), None, messages, params, stream, include_usage, _priority(body))


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _check_fields(body: dict, known: set) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"unrecognized request argument supplied: {shorten(unknown[0])}", param=unknown[0])
    for name in ("n", "best_of", "top_logprobs"):  # integers: `n: true` is refused as a non-integer, not as 1
        _integer(body, name)
    for name, neutral in _NEUTRAL.items():
        if name in body and not _neutral(body[name], neutral):
            raise bad_request(f"{name}={echo(body[name])} is not supported by this server; omit it", param=name)


def _neutral(value: Any, neutral: tuple) -> bool:
    """`value` is one of `neutral` with the same JSON type: true is not 1, 1.0 is not 1, 0 is not false."""
    return any(type(value) is type(n) and value == n for n in neutral)


def _integer(body: dict, name: str) -> Any:
    """The field as sent (None if absent), refused unless a JSON integer: GenerationParams would take true as 1."""
    value = body.get(name)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    kind = "a boolean" if isinstance(value, bool) else f"{type(value).__name__} {echo(value)}"
    raise bad_request(f"{name} must be an integer, got {kind}", param=name)


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("you must provide a model parameter (a string; see /v1/models)", param="model")
    return model


def _prompt(prompt: Any) -> Union[str, list[int]]:
    # OpenAI also takes a batch (a list of strings or of id lists); one prompt per request is served here.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("the prompt is empty; send at least one token", param="prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("the prompt is empty; send at least one token", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request(f"a batch of {len(prompt)} prompts was sent; this server takes one prompt per request",
                              param="prompt")
    raise bad_request("prompt must be a string or a list of integer token ids", param="prompt")


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a role and a content", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({"role": message["role"], "content": content})
    return out


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {echo(stream)}", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad_request("stream_options takes only include_usage", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("stream_options.include_usage must be true or false", param="stream_options")
    return stream, include


def _priority(body: dict) -> Optional[int]:
    priority = _integer(body, "priority")
    try:
        return None if priority is None else checked_priority(priority)
    except ParamError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def _stop(stop: Any) -> tuple[str, ...]:
    """At most MAX_STOPS strings of at most MAX_STOP_CHARS characters: the text of every token is matched
    against them on the event loop, and a stop string is held back from the stream while it might be starting."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOPS:
        raise bad_request(f"stop holds {len(stop)} strings; at most {MAX_STOPS} are allowed", param="stop")
    for i, s in enumerate(stop):
        if len(s) > MAX_STOP_CHARS:
            raise bad_request(f"stop[{i}] is {len(s)} characters long; a stop string may have at most "
                              f"{MAX_STOP_CHARS}", param="stop")
    return tuple(stop)


def _params(body: dict, max_tokens: Any, default_max: int, max_name: str) -> GenerationParams:
    temperature = body.get("temperature")
    top_p = body.get("top_p")
    seed = body.get("seed")
    for name in (max_name, "top_k", "seed"):
        _integer(body, name)
    stop_token_ids = body.get("stop_token_ids")
    if not isinstance(stop_token_ids, (list, type(None))):
        raise bad_request(f"stop_token_ids must be a list of integer token ids, got {echo(stop_token_ids)}",
                          param="stop_token_ids")
    try:
        return GenerationParams(
            max_new_tokens=default_max if max_tokens is None else max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=None if body.get("top_k") in (None, -1, 0) else body["top_k"],
            seed=seed,
            stop=_stop(body.get("stop")),
            stop_token_ids=tuple(stop_token_ids or ()),
            ignore_eos=False if body.get("ignore_eos") is None else body["ignore_eos"],
        )
    except ParamError as exc:
        param = max_name if exc.param == "max_tokens" else exc.param
        raise bad_request(str(exc).replace("max_tokens", param), param=param) from None
    except TypeError as exc:  # e.g. stop_token_ids not a list
        raise bad_request(f"bad parameter: {exc}") from None
