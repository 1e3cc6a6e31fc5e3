"""Text at the edges of serving: prompts to token ids, generated ids back to streamed text, stop strings.

The runtime works on token ids only. A model directory with tokenizer files gets its `transformers.AutoTokenizer`
(local files only, no remote code). A model without a tokenizer (a zoo preset) takes token ids only: a text prompt
is refused with a clear error, and generated tokens read as `<id>` (their ids are always returned as well).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from transformers import AutoTokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# A decode that ends in U+FFFD has cut a multi-byte character in half: wait for the next token.
_PARTIAL = "\ufffd"


class NoTokenizerError(ValueError):
    """Text was given to a model that has no tokenizer."""


def has_tokenizer_files(directory: Path | str) -> bool:
    return any((Path(directory) / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(directory: Path | str):
    """The tokenizer stored in a model directory, or None when there is none. Never downloads, never runs code."""
    if not has_tokenizer_files(directory):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"the tokenizer files in {directory} cannot be loaded: {reason}") from None


def token_text(token: int) -> str:
    """How a token reads when the model has no tokenizer."""
    return f"<{token}>"


class PromptCodec:
    """Prompts in (text, chat messages or ids), ids checked; ids out as text."""

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise NoTokenizerError(
                    "this model has no tokenizer, so a text prompt cannot be encoded; send token ids instead "
                    "(a list of integers), or serve a model directory that holds tokenizer files"
                )
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError("a prompt is a string or a list of integer token ids")

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        if self.tokenizer is None:
            raise NoTokenizerError(
                "this model has no tokenizer, so chat messages cannot be templated; use /v1/completions with token "
                "ids, or serve a model directory that holds tokenizer files"
            )
        if not getattr(self.tokenizer, "chat_template", None):
            raise NoTokenizerError(
                "this model's tokenizer has no chat template; use /v1/completions, or add a chat_template to its "
                "tokenizer_config.json"
            )
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    @property
    def eos_token_id(self) -> Optional[int]:
        return getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None

    def decoder(self) -> "IncrementalDecoder":
        return IncrementalDecoder(self.tokenizer)


class IncrementalDecoder:
    """Generated ids to text, one token at a time, without re-decoding the whole output each time.

    Text is decoded over a short window (the tokens since the last emitted boundary), because a token's text can
    depend on its neighbours (leading spaces, merged bytes); a window ending in half a character emits nothing yet.
    """

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens up to here are already emitted as text

    def push(self, token: int) -> str:
        self.tokens.append(int(token))
        if self.tokenizer is None:
            self._read = len(self.tokens)
            return token_text(token)
        decode = self.tokenizer.decode
        before = decode(self.tokens[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self.tokens[self._prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith(_PARTIAL):
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        return after[len(before):]


class StopStrings:
    """Cuts streamed text at the first stop string. Text that might be the start of a stop string is held back
    until the next piece shows whether it is.

    Each stop string is matched by a Knuth-Morris-Pratt automaton fed only the new piece, so matching a piece
    takes time linear in its length (per stop) however long the stops are; the text held back, at most the longest
    stop less one character, is copied once per piece.
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self._fallbacks = [_kmp_fallbacks(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: how many of its first characters the text ends with
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that can be released now; sets `stopped` once a stop string appeared (it is not released)."""
        if self.stopped:
            return ""
        text = self._held + piece
        cut = -1
        for i, (stop, fallbacks) in enumerate(zip(self.stops, self._fallbacks)):
            matched = self._matched[i]
            for end, char in enumerate(piece, len(self._held) + 1):
                while matched and stop[matched] != char:
                    matched = fallbacks[matched - 1]
                if stop[matched] == char:
                    matched += 1
                if matched == len(stop):  # the first time this stop appears, ending at text[end - 1]
                    cut = end - matched if cut < 0 else min(cut, end - matched)
                    break
            self._matched[i] = matched
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = max(self._matched, default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What was held back, once the output ended without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _kmp_fallbacks(stop: str) -> list[int]:
    """For each prefix of `stop`, the length of its longest proper prefix that is also its suffix."""
    fallbacks = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fallbacks[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fallbacks[i] = k
    return fallbacks


@dataclass
class Delta:
    """One step of a streamed output: new token ids and the text they released (possibly empty)."""

    token_ids: list[int]
    text: str


class OutputText:
    """One request's output as text: detokenised incrementally, cut at stop strings."""

    def __init__(self, codec: PromptCodec, stop: Sequence[str] = ()):
        self._decoder = codec.decoder()
        self._stops = StopStrings(stop)
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def push(self, token: int) -> Delta:
        piece = self._stops.feed(self._decoder.push(token))
        self.text += piece
        return Delta([int(token)], piece)

    def finish(self) -> str:
        tail = self._stops.flush()
        self.text += tail
        return tail
