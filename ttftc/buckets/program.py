"""One compiled prefill graph and what it is specialised to: the unit the runtime, cache and artifacts share.

Kept free of Dynamo and the backend, so loading an artifact does not import the compiler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

LOGITS_MODES = ("all", "last")
# Every tensor a prefill graph may take, by name (a graph takes the ones its model reads).
INPUT_NAMES = ("input_ids", "position_ids", "last_index")


@dataclass(frozen=True, order=True)
class GraphSignature:
    """What one compiled graph is specialised to.

    logits: "all" gives logits at every position; "last" only at each sequence's last real token (the
            lm_head then runs on one row per sequence, which is most of the saving for a large vocabulary).
    kv:     whether the graph also returns every layer's keys and values.
    """

    bucket: int
    batch: int = 1
    logits: str = "all"
    kv: bool = True

    def __post_init__(self) -> None:
        if self.logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {LOGITS_MODES}, got {self.logits!r}")
        if self.bucket < 1 or self.batch < 1:
            raise ValueError(f"bucket and batch must be positive, got {self.bucket}, {self.batch}")

    @property
    def name(self) -> str:
        return f"b{self.bucket}_n{self.batch}_{self.logits}_{'kv' if self.kv else 'nokv'}"

    def to_dict(self) -> dict:
        return {"bucket": self.bucket, "batch": self.batch, "logits": self.logits, "kv": self.kv}

    @classmethod
    def from_dict(cls, data: dict) -> "GraphSignature":
        """The signature `to_dict` wrote. The dict comes from a file, so every field is checked for its exact
        type: a ValueError names the first field that is missing or wrong."""
        if not isinstance(data, dict) or set(data) != {"bucket", "batch", "logits", "kv"}:
            raise ValueError(f"a graph signature has exactly the fields bucket, batch, logits, kv; got {data!r}")
        for name, kind in (("bucket", int), ("batch", int), ("logits", str), ("kv", bool)):
            value = data[name]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"graph signature field {name!r} must be {kind.__name__}, got {value!r}")
        return cls(data["bucket"], data["batch"], data["logits"], data["kv"])


class GraphProgram:
    """A compiled prefill graph with named inputs and outputs; calling it runs no compiler at all."""

    def __init__(self, signature: GraphSignature, gm: fx.GraphModule, inputs: Sequence[str], outputs: Sequence[str]):
        self.signature = signature
        self.gm = gm
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        results = self.gm(*[tensors[name] for name in self.inputs])
        return dict(zip(self.outputs, results))


def output_names(count: int) -> tuple[str, ...]:
    """logits, then keys and values per layer: k0, v0, k1, v1, ..."""
    if count < 1 or count % 2 == 0:
        raise ValueError(f"a prefill graph returns logits plus key/value pairs; got {count} outputs")
    names = ["logits"]
    for layer in range((count - 1) // 2):
        names += [f"k{layer}", f"v{layer}"]
    return tuple(names)
