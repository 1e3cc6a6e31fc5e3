"""The ordered pass pipeline. A pass that raises is recorded and rolled back, so a compile never fails because
of a pass and the graph it leaves behind is the one from before that pass."""

from __future__ import annotations

import hashlib

import torch.fx as fx

from ttftc.config import Config
from ttftc.passes.base import GraphPass, PassStats
from ttftc.fx_utils import copy_graph
from ttftc.passes.registry import enabled_passes, pass_classes


class PassManager:
    def __init__(self, config: Config):
        self.config = config
        enabled = set(enabled_passes(config))
        self.passes: list[GraphPass] = [cls(config) for cls in pass_classes() if cls.name in enabled]

    def uuid(self) -> str:
        parts = [self.config.digest()] + [f"{p.name}:{p.uuid()}" for p in self.passes]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def run(self, gm: fx.GraphModule) -> list[PassStats]:
        results = []
        for graph_pass in self.passes:
            saved = copy_graph(gm.graph)
            try:
                results.append(graph_pass.run(gm))
            except Exception as exc:
                gm.graph = saved
                gm.recompile()
                stats = graph_pass.stats
                stats.error = f"{type(exc).__name__}: {exc} (pass rolled back, graph left as before it)"
                stats.matched = 0
                results.append(stats)
        return results
