"""How the next token is picked from the last position's logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Sampling:
    """Greedy by default. `temperature > 0` samples, optionally from the `top_k` best and from the smallest set of
    tokens whose probabilities add up to `top_p` (nucleus sampling); `seed` makes it repeatable."""

    temperature: float = 0.0
    top_k: Optional[int] = None
    seed: Optional[int] = None
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def generator(self) -> Optional[torch.Generator]:
        return torch.Generator().manual_seed(self.seed) if self.seed is not None else None

    def pick(self, logits: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
        """The next token id from 1-D `logits`."""
        if self.temperature == 0.0:
            return int(torch.argmax(logits).item())
        scores = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < scores.numel():
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            # Keep a token while the mass before it is below top_p: the most likely token always stays.
            drop = (torch.cumsum(ordered, dim=-1) - ordered) >= self.top_p
            probs = probs.scatter(-1, order, ordered.masked_fill(drop, 0.0))
        return int(torch.multinomial(probs, 1, generator=generator).item())


GREEDY = Sampling()
