"""The shape every ttftc pass has: find candidates, guard each one, replace the ones the guard proves safe.

A guard returns None to accept or a reason to reject; the reason lands in the explain report. A pass that
cannot prove a match safe leaves the graph alone, so a guard errs on the side of rejecting.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Optional

import torch.fx as fx

from ttftc.config import Config


@dataclass
class PassStats:
    name: str
    candidates: int = 0
    matched: int = 0
    rejections: list[str] = field(default_factory=list)
    error: Optional[str] = None
    decisions: list[str] = field(default_factory=list)  # what the pass chose for the whole graph, and why

    def reject(self, reason: str) -> None:
        self.rejections.append(reason)

    def merge(self, other: "PassStats") -> None:
        self.candidates += other.candidates
        self.matched += other.matched
        self.rejections.extend(other.rejections)
        self.decisions.extend(other.decisions)
        if other.error:
            self.error = f"{self.error}; {other.error}" if self.error else other.error


class GraphPass(ABC):
    """Subclasses set `name` and implement find/guard/replace; ttftc.passes.registry.PIPELINE places them."""

    name: ClassVar[str]

    def __init__(self, config: Config):
        self.config = config
        self.stats = PassStats(self.name)

    # -- identity ---------------------------------------------------------------------------------------
    def options(self) -> dict:
        """Settings that change what this pass emits; they join the uuid."""
        return {}

    def uuid(self) -> str:
        source = inspect.getsource(sys.modules[type(self).__module__])
        payload = source + _shared_helpers_hash() + json.dumps(self.options(), sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    # -- the three parts of a pass -----------------------------------------------------------------------
    @abstractmethod
    def find(self, gm: fx.GraphModule) -> Iterable[Any]:
        """Yield candidate matches: cheap structural anchors, re-validated by `guard`."""

    @abstractmethod
    def guard(self, gm: fx.GraphModule, match: Any) -> Optional[str]:
        """None if the match is proven safe to replace, else the reason it is not (for explain)."""

    @abstractmethod
    def replace(self, gm: fx.GraphModule, match: Any) -> None:
        """Rewrite the match into ttftc ops; results must keep the replaced nodes' shapes and dtypes."""

    # -- driver ------------------------------------------------------------------------------------------
    def run(self, gm: fx.GraphModule) -> PassStats:
        for match in list(self.find(gm)):
            self.stats.candidates += 1
            reason = self.guard(gm, match)
            if reason is not None:
                self.stats.reject(reason)
                continue
            self.replace(gm, match)
            self.stats.matched += 1
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
        return self.stats


@functools.cache
def _shared_helpers_hash() -> str:
    """Passes build on shared helper modules (ttftc/fx_utils.py and the `_`-prefixed matchers and rewrites), whose
    source decides what a pass emits as much as the pass's own module does."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted([package.parent / "fx_utils.py", *package.glob("_*.py")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()
