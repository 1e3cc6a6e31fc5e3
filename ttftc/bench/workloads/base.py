"""The workload plug-in interface: Request and Server (defined in request.py), WorkloadContext, ServeTarget and
the Workload base class.

See the package docstring (ttftc/bench/workloads/__init__.py) for how to write a plug-in.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch

from ttftc.bench.models import example_prompt
from ttftc.bench.workloads.replay import replay
from ttftc.bench.workloads.request import Request, Server

__all__ = ["Request", "ServeTarget", "Server", "Workload", "WorkloadContext"]


@dataclass(frozen=True)
class WorkloadContext:
    """What the harness tells a workload for one run."""

    seq: int  # the nominal prompt length of this row of the report (--seq)
    vocab_size: int
    seed: int  # differs per measured repeat; warm-up runs use their own seeds
    device: str = "cpu"

    def prompt(self, length: int, *, seed: int) -> torch.Tensor:
        """A (1, length) prompt of random token ids, fixed by `seed` (the single-prompt workload uses seed 0)."""
        return example_prompt(self.vocab_size, length, seed=seed, device=self.device)


@dataclass(frozen=True)
class ServeTarget:
    """The variant under test, as a workload's server sees it.

    model:    the (compiled or eager) Hugging Face model; call it with any keyword arguments, e.g.
              `model(input_ids=suffix, past_key_values=kv, logits_to_keep=1)` to reuse a cached prefix.
    prefill:  the plain first-token forward over a whole prompt (ttftc.bench.models.prefill on `model`).
    variant:  the variant's name, for servers that need to know.
    """

    model: Callable[..., Any]
    prefill: Callable[[torch.Tensor], Any]
    variant: str
    device: str = "cpu"


class Workload(abc.ABC):
    """A plug-in: subclass, set `name` and `description`, implement `requests`, decorate with @register_workload."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    @abc.abstractmethod
    def requests(self, ctx: WorkloadContext) -> Sequence[Request]:
        """The requests of one run, in issue order (or with arrival times)."""

    def make_server(self, target: ServeTarget) -> Server:
        """A fresh server for one run. Called once per run (every warm-up and every measured repeat), so any
        state it keeps (a prefix cache) starts empty each run and nothing leaks from warm-up into a measurement.
        The default is stateless: every request is a full prefill of its prompt."""
        return lambda request: target.prefill(request.ids)

    def replay(self, requests: Sequence[Request], server: Server, *, device: str = "cpu") -> list[float]:
        """TTFT in seconds of every measured request. The default serves one request at a time
        (ttftc.bench.workloads.replay). A workload whose server interleaves requests (a step scheduler mixing
        prefill chunks with decodes) overrides this: one-at-a-time replay cannot show that overlap."""
        return replay(requests, server, device=device)

    def table(self) -> Optional[dict]:
        """Figures the (variant, --seq) rows cannot hold, gathered over the run (the batch workload's TTFT per
        batch size): {"kind": ..., "rows": [{"variant", "seq", ...}, ...]}, written to the JSON as
        `workload_table` and printed after the rows. None (the default): nothing beyond the rows."""
        return None
