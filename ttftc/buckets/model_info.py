"""What the bucketed runtime reads from a model besides its graph: the longest prompt it takes and its vocabulary.

Here rather than with the compiler (compiled.py) because the compile cache checks a stored graph's token ids
against the vocabulary without importing the capture machinery.
"""

from __future__ import annotations

from typing import Optional

import torch


def max_positions_of(model: torch.nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_size_of(model: torch.nn.Module) -> Optional[int]:
    """The number of rows of the model's token embedding: every valid token id is below it."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    if isinstance(embeddings, torch.nn.Embedding):
        return embeddings.num_embeddings
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "vocab_size", None)
    return value if isinstance(value, int) and value > 0 else None
