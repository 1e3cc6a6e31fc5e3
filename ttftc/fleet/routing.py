"""Which replica serves a request.

Prefix affinity: a request's routing key is its tenant plus the beginning of its prompt, and the key picks a
replica on a consistent-hash ring over the healthy replicas. Turns that share a system prompt (and a tenant) so land
on the replica that cached it; a replica leaving or rejoining the ring moves only the keys it owned. Like Ray Serve
LLM's PrefixCacheAffinityRouter, locality yields to load: when the preferred replica has `imbalance` more requests
in flight than the least-loaded one, the least-loaded one serves (it misses the cache, but does not queue behind a
hot prefix). `balanced` ignores the prompt: least loaded, ties broken round robin.

The key is taken from the request body without a tokenizer, so the ingress loads no model: the first
`prefix_tokens` token ids of a token-id prompt, else the first `prefix_tokens * CHARS_PER_TOKEN` characters of the
prompt text (a chat request's messages, role and content, in order). The tenant is part of the key because the
prefix cache is per tenant: the same prompt text of two tenants shares no cached block, so nothing is gained by
sending them to one replica.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

ROUTINGS = ("prefix", "balanced")
CHARS_PER_TOKEN = 4  # a rough English average: the text key spans about as much prompt as the token key
VIRTUAL_NODES = 64  # points per replica on the ring: spreads keys evenly over few replicas


@dataclass(frozen=True)
class RoutingConfig:
    """routing: "prefix" or "balanced". prefix_tokens: how much of the prompt the key covers (two prefix-cache
    blocks by default: long enough to tell system prompts apart, short enough to end inside one). imbalance: how
    many more requests in flight than the least-loaded replica the preferred one may have before load wins.
    recheck_s: how long a replica that failed stays out of the ring before a request probes it again."""

    routing: str = "prefix"
    prefix_tokens: int = 32
    imbalance: int = 4
    recheck_s: float = 2.0

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if not isinstance(self.prefix_tokens, int) or self.prefix_tokens < 1:
            raise ValueError(f"prefix_tokens must be a positive int, got {self.prefix_tokens!r}")
        if not isinstance(self.imbalance, int) or self.imbalance < 0:
            raise ValueError(f"imbalance must be a non-negative int, got {self.imbalance!r}")


def routing_key(body: Any, tenant: Optional[str], prefix_tokens: int) -> Optional[bytes]:
    """The key of a parsed request body (module docstring), or None when it has no prompt to key on (a malformed
    request: any replica answers its 400 as well as another)."""
    head = _prompt_head(body, prefix_tokens)
    if head is None:
        return None
    return repr((tenant, head)).encode()


def _prompt_head(body: Any, prefix_tokens: int):
    if not isinstance(body, dict):
        return None
    chars = prefix_tokens * CHARS_PER_TOKEN
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a batch of prompts: keyed on the first
    if isinstance(prompt, str):
        return prompt[:chars]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return tuple(prompt[:prefix_tokens])
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        text = ""
        for message in messages:
            if not isinstance(message, dict):
                return None
            text += f"{message.get('role')}\x00{message.get('content')}\x00"
            if len(text) >= chars:
                break
        return text[:chars]
    return None


def _point(data: bytes) -> int:
    # A stable hash (not Python's salted hash()): every ingress, and every restart, maps a key to the same replica.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass
class ReplicaState:
    name: str
    in_flight: int = 0
    served: int = 0
    healthy: bool = True
    retry_at: float = 0.0  # when an unhealthy replica may be probed again (time.monotonic)


@dataclass
class Choice:
    replica: str
    reason: str  # "affinity", "load" (the preferred replica was too busy), "balanced", "only" (one candidate)


class Router:
    """The ingress's routing state: replicas, their requests in flight (counted by the ingress itself, the one
    place every request passes), and their health. Not thread-safe: the ingress calls it from its event loop."""

    def __init__(self, replicas: Sequence[str], config: RoutingConfig = RoutingConfig(), clock=time.monotonic):
        if not replicas or len(set(replicas)) != len(replicas):
            raise ValueError(f"the router needs one or more distinct replica names, got {list(replicas)!r}")
        self.config = config
        self.replicas = {name: ReplicaState(name) for name in replicas}
        self._clock = clock
        self._turn = itertools.count()
        self._ring = sorted((_point(f"{name}#{i}".encode()), name) for name in replicas for i in range(VIRTUAL_NODES))

    def candidates(self, exclude: Sequence[str] = ()) -> list[str]:
        """Healthy replicas, plus unhealthy ones whose recheck time has come (the caller probes those first)."""
        now = self._clock()
        return [r.name for r in self.replicas.values()
                if r.name not in exclude and (r.healthy or now >= r.retry_at)]

    def choose(self, key: Optional[bytes], exclude: Sequence[str] = ()) -> Optional[Choice]:
        """The replica for a request with routing key `key`; None when every replica is down."""
        names = self.candidates(exclude)
        if not names:
            return None
        if len(names) == 1:
            return Choice(names[0], "only")
        least = min(self.replicas[n].in_flight for n in names)
        idle = [n for n in names if self.replicas[n].in_flight == least]
        if self.config.routing == "balanced" or key is None:
            return Choice(idle[next(self._turn) % len(idle)], "balanced")
        preferred = self.preferred(key, names)
        if self.replicas[preferred].in_flight - least > self.config.imbalance:
            return Choice(idle[next(self._turn) % len(idle)], "load")
        return Choice(preferred, "affinity")

    def preferred(self, key: bytes, names: Sequence[str]) -> str:
        """The first of `names` clockwise from the key's point on the ring."""
        allowed = set(names)
        start = bisect.bisect(self._ring, (_point(key), ""))
        for offset in range(len(self._ring)):
            _, name = self._ring[(start + offset) % len(self._ring)]
            if name in allowed:
                return name
        raise ValueError("no candidate replica is on the ring")  # names are a subset of the ring's replicas

    def started(self, name: str) -> None:
        state = self.replicas[name]
        state.in_flight += 1
        state.served += 1

    def finished(self, name: str) -> None:
        self.replicas[name].in_flight -= 1

    def failed(self, name: str) -> None:
        """The replica could not be reached: out of the ring until `recheck_s` from now."""
        state = self.replicas[name]
        state.healthy = False
        state.retry_at = self._clock() + self.config.recheck_s

    def recovered(self, name: str) -> None:
        self.replicas[name].healthy = True
