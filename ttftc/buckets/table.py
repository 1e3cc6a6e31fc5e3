"""The bucket table: which padded lengths exist, and which one a prompt goes to."""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

# Powers of two from 16 to 4096: at most 2x padding waste, 9 graphs.
DEFAULT_BUCKETS: tuple[int, ...] = tuple(2**k for k in range(4, 13))


def effective_buckets(buckets: Optional[Sequence[int]], max_positions: Optional[int] = None) -> tuple[int, ...]:
    """The table actually compiled: the configured (or default) buckets, capped at the model's position limit.

    A bucket longer than the model's position table could never hold a real prompt of that length, and
    learned position embeddings (GPT-2) would index past their end; the limit itself replaces such buckets.
    """
    table = tuple(buckets) if buckets else DEFAULT_BUCKETS
    if max_positions is None or table[-1] <= max_positions:
        return table
    capped = [b for b in table if b < max_positions]
    return tuple(capped + [max_positions])


def bucket_for(length: int, table: Sequence[int]) -> Optional[int]:
    """The smallest bucket that holds `length` tokens, or None when it is longer than the largest."""
    if length < 1:
        raise ValueError(f"a prompt needs at least one token, got length {length}")
    i = bisect.bisect_left(table, length)
    return table[i] if i < len(table) else None
