"""The synthetic task behind ttftc's quality check: reverse a sequence and map every symbol through a fixed rule.

A prompt is `BOS s_1 .. s_n SEP`, the answer is `f(s_n) .. f(s_1)` with f(s) = (3 s + 1) mod SYMBOLS. Solving it
needs attention (which input position to read: a positional, causal lookup) and the MLP (the symbol map), so both
halves of every layer carry accuracy, and any precision loss in either shows up as wrong answer tokens.

Accuracy is teacher-forced: one prefill over prompt + answer, and an answer token counts as right when the argmax
of the logits just before it is that token. That is exactly what prefill computes, so it measures ttftc's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SYMBOLS = 16
LENGTH = 8
BOS = SYMBOLS
SEP = SYMBOLS + 1
VOCAB = SYMBOLS + 2
SEQ_LEN = 1 + LENGTH + 1 + LENGTH  # BOS, input, SEP, answer


def rule(symbols: torch.Tensor) -> torch.Tensor:
    return (3 * symbols + 1) % SYMBOLS


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, SEQ_LEN]: prompt followed by the answer
    answer_mask: torch.Tensor  # [B, SEQ_LEN] True where the *next* token is an answer token


def make_batch(size: int, generator: torch.Generator) -> Batch:
    source = torch.randint(0, SYMBOLS, (size, LENGTH), generator=generator)
    answer = rule(source.flip(-1))
    bos = torch.full((size, 1), BOS)
    sep = torch.full((size, 1), SEP)
    ids = torch.cat([bos, source, sep, answer], dim=1)
    mask = torch.zeros(size, SEQ_LEN, dtype=torch.bool)
    mask[:, LENGTH + 1 : SEQ_LEN - 1] = True  # logits at SEP .. second-to-last predict the answer tokens
    return Batch(ids, mask)


def eval_batch(size: int = 512, seed: int = 12345) -> Batch:
    """A fixed held-out set: training draws from a different generator, so these exact prompts were not seen
    (with 16^8 possible inputs, overlap would be negligible anyway)."""
    return make_batch(size, torch.Generator().manual_seed(seed))


def accuracy(logits: torch.Tensor, batch: Batch) -> float:
    """Percentage of answer tokens predicted right, from logits [B, SEQ_LEN, VOCAB]."""
    predicted = logits[:, :-1].argmax(-1)
    target = batch.ids[:, 1:]
    mask = batch.answer_mask[:, :-1]
    return 100.0 * (predicted[mask] == target[mask]).float().mean().item()
