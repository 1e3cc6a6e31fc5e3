"""The ttftc backend with regional compilation (Config.regions="blocks"): the frozen graph is compiled region by
region (compile.py) instead of whole. Everything before (Dynamo, AOTAutograd, freezing) and after (the boxed
runner, the weight guard) is TtftcBackend's own.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch.fx as fx

from ttftc.capture import FlatInputs
from ttftc.dynamo_backend import LoweredGraph, TtftcBackend, _boxed
from ttftc.fx_utils import copy_graph
from ttftc.pipeline import run_pipeline
from ttftc.regions.compile import RegionStats, compile_regions


class RegionalBackend(TtftcBackend):
    """TtftcBackend whose eager code generator compiles each distinct repeated block once.

    region_stats: one RegionStats per graph compiled, in order (how many regions, full compiles, reuses).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.region_stats: list[RegionStats] = []

    def _compile_frozen(self, aten_gm: fx.GraphModule, inputs: FlatInputs, num_aot_inputs: int) -> Callable:
        live, notes = self._freeze(aten_gm, inputs, num_aot_inputs)
        saved = (copy_graph(aten_gm.graph), dict(aten_gm._buffers), dict(aten_gm._modules))
        try:
            report, stats = compile_regions(aten_gm, self.config, autotune_cache=self.autotune_cache, notes=notes)
        except Exception as exc:  # noqa: BLE001  (a graph regions do not fit still compiles, whole)
            aten_gm.graph, aten_gm._buffers, aten_gm._modules = saved[0], saved[1], saved[2]
            aten_gm.recompile()
            notes.append(f"regions: none, the graph compiled whole (splitting it raised {type(exc).__name__}: {exc})")
            warnings.warn(notes[-1], stacklevel=2)
            report, stats = run_pipeline(aten_gm, self.config, autotune_cache=self.autotune_cache,
                                         notes=notes), RegionStats()
        self.reports.append(report)
        self.region_stats.append(stats)
        self.graph_modules.append(aten_gm)
        if self.on_lowered is not None:
            self.on_lowered(LoweredGraph(aten_gm, tuple(live), num_aot_inputs))
        return _boxed(aten_gm, live)
