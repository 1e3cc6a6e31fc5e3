"""Multi-turn chat: turn N prefills only its new tokens on top of the KV of turns 1..N-1 and their replies.

The session keeps its KV handle between turns. The last reply token was sampled but never fed to the model, so it
is prepended to the next turn's tokens. With a prefix cache on the engine, every turn also publishes its full
blocks, so a new session that replays the same history (a retry, a fork) starts warm too; sessions without a
tenant share the engine's default namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional

from ttftc.runtime.chunked import FirstToken
from ttftc.runtime.engine import PrefillEngine, PromptIds
from ttftc.runtime.kv import KVHandle
from ttftc.runtime.sampling import GREEDY, Sampling


@dataclass
class Turn:
    first: FirstToken
    reply: list[int]

    @property
    def cached_tokens(self) -> int:
        return self.first.cached_tokens

    @property
    def computed_tokens(self) -> int:
        return self.first.computed_tokens


class ChatSession:
    def __init__(self, engine: PrefillEngine, tenant: Hashable = None):
        self.engine = engine
        self.tenant = tenant
        self.turns: list[Turn] = []
        self._handle: Optional[KVHandle] = None
        self._unfed: list[int] = []  # the last reply token: produced, not yet in the KV
        self._closed = False

    @property
    def history(self) -> list[int]:
        """Every token of the conversation so far (prompts and replies)."""
        return (self._handle.token_ids if self._handle is not None else []) + self._unfed

    def prefill(self, turn_ids: PromptIds, sampling: Sampling = GREEDY) -> FirstToken:
        """Prefill the next user turn and return its first reply token (the timed part of a turn)."""
        if self._closed:
            raise ValueError("this chat session is closed")
        if self._handle is None:
            first = self.engine.first_token(turn_ids, tenant=self.tenant, sampling=sampling)
            self._handle = first.kv
        else:
            new = self.engine.validate(turn_ids, already=len(self.history))
            first = self.engine.extend(self._handle, self._unfed + new, sampling=sampling)
        self._unfed = [first.token]
        return first

    def send(self, turn_ids: PromptIds, max_new_tokens: int = 1, sampling: Sampling = GREEDY,
             eos_token_id: Optional[int] = None) -> Turn:
        """One full turn: prefill `turn_ids`, decode a reply of up to `max_new_tokens` tokens."""
        first = self.prefill(turn_ids, sampling)
        reply = self.engine.generate(first, max_new_tokens, sampling, eos_token_id)
        self._unfed = [reply[-1]]
        turn = Turn(first, reply)
        self.turns.append(turn)
        return turn

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._handle is not None:
            self._handle.release()
            self._handle = None

    def __enter__(self) -> "ChatSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
