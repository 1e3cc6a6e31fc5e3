"""Pre-warmed prompts (`ttftc serve --warm-prompts FILE`): prompts prefilled into the prefix cache before the server
reports ready, and pinned there, so the first request that starts with one is served from the cache.

The file holds JSON lines, one prompt each:

    {"prompt": "You are a helpful assistant ...", "tenant": "acme"}
    {"prompt": [1, 887, 338, ...], "tenant": "acme"}

`prompt` is text (the model's tokenizer encodes it) or a list of token ids; `tenant` is the prefix-cache namespace
whose requests it serves: the value of the server's tenant header. A request without that header shares no cache
(it runs PRIVATE), so the server refuses a line without a tenant: no request could ever hit it. (In Python,
`warm_prompts(llm, prompts)` without `require_tenant` warms a prompt without one in the LLM's own namespace, the one
its in-process calls share.) Blank lines are skipped.

The file is untrusted data: it is read as a regular file of at most MAX_FILE_BYTES (no symlink at its last
component, no FIFO), at most MAX_LINE_CHARS per line and MAX_PROMPTS prompts, and nothing in it becomes code or a
path. Every bad line is reported with its file:line before anything is prefilled, and a failure while warming
(the pins would not fit the cache, a prefill fails) undoes every pin taken: the server starts with all of the
file or refuses to start.

Each prompt's full cache blocks are pinned (runtime/prefix_cache.py): they count against the cache's budget and
are never evicted, so the budget must hold them all, with room to spare for the traffic's own prefixes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from ttftc.confined import UnsafePathError, read_regular
from ttftc.llm import LLM
from ttftc.runtime.prefix_cache import CacheLease, PrefixCacheStats
from ttftc.text import NoTokenizerError

MAX_FILE_BYTES = 64 << 20
MAX_LINE_CHARS = 1 << 20
MAX_PROMPTS = 10_000
_SHOWN_ERRORS = 20  # a file of a million bad lines gets a readable message, not a million lines of it


class WarmPromptsError(ValueError):
    """The warm-prompts file, or one of its prompts, cannot be served; the message names file:line for each."""


@dataclass(frozen=True)
class WarmPrompt:
    prompt: Union[str, tuple[int, ...]]
    tenant: Optional[str] = None
    where: str = "<prompt>"  # file:line, for messages


@dataclass(frozen=True)
class Warmed:
    """The pins a warm-up took: `unpin()` hands them back to the cache's LRU."""

    pins: tuple[CacheLease, ...]
    tokens: int  # prompt tokens pinned, summed over prompts

    def unpin(self, llm: LLM) -> None:
        for lease in self.pins:
            llm.unpin(lease)


def read_warm_prompts(path: Union[str, Path]) -> list[WarmPrompt]:
    """The prompts of a warm-prompts file, or a WarmPromptsError naming every bad line."""
    path = Path(path)
    try:
        data = read_regular(path, limit=MAX_FILE_BYTES)
    except FileNotFoundError:
        raise WarmPromptsError(f"{path}: no such file") from None
    except (UnsafePathError, OSError) as exc:
        raise WarmPromptsError(f"{path}: {exc} (give a regular file of at most {MAX_FILE_BYTES >> 20} MiB)") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise WarmPromptsError(f"{path}:{line}: not UTF-8 text ({exc.reason}); the file holds JSON lines") from None
    prompts: list[WarmPrompt] = []
    errors: list[str] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if len(prompts) >= MAX_PROMPTS:
            errors.append(f"{where}: more than {MAX_PROMPTS} prompts; warm the most used ones only")
            break
        try:
            prompts.append(_parse_line(line, where))
        except WarmPromptsError as exc:
            errors.append(str(exc))
    _raise_if(errors)
    return prompts


def _parse_line(line: str, where: str) -> WarmPrompt:
    if len(line) > MAX_LINE_CHARS:
        raise WarmPromptsError(f"{where}: a line of {len(line)} characters; at most {MAX_LINE_CHARS} are read")
    try:
        value = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise WarmPromptsError(f"{where}: not a JSON object ({type(exc).__name__}: {str(exc)[:200]}); each line is "
                               '{"prompt": text or [token ids], "tenant": name}') from None
    if not isinstance(value, dict):
        raise WarmPromptsError(f'{where}: a JSON {type(value).__name__}, not an object {{"prompt": ..., '
                               '"tenant": ...}')
    unknown = sorted(set(value) - {"prompt", "tenant"})
    if unknown:
        raise WarmPromptsError(f"{where}: unknown field {unknown[0][:100]!r}; a line has only prompt and tenant")
    prompt = value.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise WarmPromptsError(f"{where}: the prompt is empty")
    elif isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise WarmPromptsError(f"{where}: prompt must be text or a non-empty list of integer token ids")
        prompt = tuple(prompt)
    else:
        raise WarmPromptsError(f"{where}: prompt must be text or a list of integer token ids, got "
                               f"{type(prompt).__name__}")
    tenant = value.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise WarmPromptsError(f"{where}: tenant must be a non-empty string (the tenant header's value)")
    return WarmPrompt(prompt, tenant, where)


def warm_prompts(llm: LLM, prompts: Sequence[WarmPrompt], *, require_tenant: bool = False) -> Warmed:
    """Prefill every prompt into `llm`'s prefix cache and pin it, all or nothing (the module docstring)."""
    if not prompts:
        return Warmed((), 0)
    cache = llm.stats()["prefix_cache"]
    if cache is None:
        raise WarmPromptsError("warm prompts need the prefix cache; it is off (--no-prompt-cache)")
    encoded: list[list[int]] = []
    errors: list[str] = []
    for prompt in prompts:
        try:
            encoded.append(_encode(llm, prompt, cache.block_size, require_tenant))
        except WarmPromptsError as exc:
            errors.append(str(exc))
    _raise_if(errors)
    _check_capacity(cache, llm.geometry.block_bytes(cache.block_size), prompts, encoded)
    pins: list[CacheLease] = []
    try:
        for prompt, ids in zip(prompts, encoded):
            try:  # tenant None: the LLM's own namespace (LLM.generate's default)
                pins.append(llm.warm(ids, tenant=prompt.tenant))
            except (RuntimeError, ValueError, TimeoutError) as exc:
                raise WarmPromptsError(f"{prompt.where}: warming failed, nothing is pinned: {exc}") from None
    except BaseException:
        for lease in pins:
            llm.unpin(lease)
        raise
    return Warmed(tuple(pins), sum(len(ids) for ids in encoded))


def _encode(llm: LLM, prompt: WarmPrompt, block_size: int, require_tenant: bool) -> list[int]:
    if require_tenant and prompt.tenant is None:
        raise WarmPromptsError(f"{prompt.where}: no tenant: requests without the tenant header share no cache, so "
                               'nothing could hit this prompt; add "tenant": the header value of the requests that '
                               "send it")
    try:
        ids = llm.encode(prompt.prompt if isinstance(prompt.prompt, str) else list(prompt.prompt))
        llm.check_length(ids, 1)
    except NoTokenizerError as exc:
        raise WarmPromptsError(f"{prompt.where}: {exc}") from None
    except ValueError as exc:  # ids outside the vocabulary, too long for the model
        raise WarmPromptsError(f"{prompt.where}: {exc}") from None
    if len(ids) < block_size:
        raise WarmPromptsError(f"{prompt.where}: {len(ids)} tokens, less than one prefix-cache block "
                               f"({block_size} tokens): nothing of it would be cached")
    return ids


def _check_capacity(cache: PrefixCacheStats, block_bytes: int, prompts: Sequence[WarmPrompt],
                    encoded: list[list[int]]) -> None:
    """Refuse, before any prefill, pins that alone would not fit the cache: blocks shared by prompts of one tenant
    count once, as the cache stores them once."""
    bs = cache.block_size
    tries: dict[object, dict] = {}
    blocks = 0
    for prompt, ids in zip(prompts, encoded):
        node = tries.setdefault(prompt.tenant, {})
        for i in range(len(ids) // bs):
            key = tuple(ids[i * bs:(i + 1) * bs])
            if key not in node:
                node[key] = {}
                blocks += 1
            node = node[key]
    needed = blocks * block_bytes
    if needed > cache.budget_bytes:
        raise WarmPromptsError(
            f"the {len(prompts)} warm prompts pin {blocks} cache blocks ({needed / 2**20:.1f} MiB of KV), more than "
            f"the prefix cache's budget of {cache.budget_bytes / 2**20:.1f} MiB: raise --prefix-cache-mb or warm "
            "fewer prompts")


def _raise_if(errors: list[str]) -> None:
    if not errors:
        return
    shown = errors[:_SHOWN_ERRORS]
    more = len(errors) - len(shown)
    raise WarmPromptsError("\n".join(shown + ([f"... and {more} more"] if more else [])))
