"""How the next token is picked from the last position's logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Sampling:
    """Greedy by default. `temperature > 0` samples, optionally from the `top_k` best; `seed` makes it repeatable."""

    temperature: float = 0.0
    top_k: Optional[int] = None
    seed: Optional[int] = None

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")

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
        return int(torch.multinomial(probs, 1, generator=generator).item())


GREEDY = Sampling()
