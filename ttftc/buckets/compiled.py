"""The just-in-time graph source: plans and compiles bucket graphs from a live model, on first use.

With a compile cache, a graph compiled once (in any process) is loaded instead: no Dynamo trace, no passes,
no lowering. Without one, each bucket costs one trace and compile the first time it is used. Prompts no bucket
holds run through `dynamic_runner`, the model compiled with dynamic shapes.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from ttftc.buckets.capture import PrefillAdapter, analyse_padding, capture_graph
from ttftc.buckets.program import GraphProgram, GraphSignature, output_names
from ttftc.buckets.constants import ConstantPool
from ttftc.buckets.model_info import max_positions_of, vocab_size_of
from ttftc.buckets.plan import BucketPlan
from ttftc.buckets.table import DEFAULT_BUCKETS, effective_buckets
from ttftc.config import Config
from ttftc import dynamo_backend
from ttftc.report import Report


def model_device(model: torch.nn.Module, config: Config) -> torch.device:
    if config.device != "auto":
        return torch.device(config.device)
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def named_outputs(flat) -> dict[str, torch.Tensor]:
    return dict(zip(output_names(len(flat)), flat))


def dynamic_runner(model: torch.nn.Module, config: Config, logits: str, kv: bool) -> Callable[[dict], dict]:
    """The model compiled by ttftc with dynamic shapes (through Dynamo): the path for prompts with no bucket."""
    compiled = torch.compile(PrefillAdapter(model, logits=logits, kv=kv), backend=dynamo_backend.TtftcBackend(config),
                             dynamic=True)

    def run(tensors: dict) -> dict:
        return named_outputs(compiled(**tensors))

    return run


class CompiledGraphs:
    """GraphSource for a live model. `compiles` counts graphs this process actually traced and compiled,
    `cache_hits` those it loaded from the compile cache instead (the server's /metrics reports both)."""

    def __init__(self, model: torch.nn.Module, config: Config, *, cache=None):
        self.model = model
        self.config = config
        self.cache = cache
        self.device = model_device(model, config)
        self.max_positions = max_positions_of(model)
        self.vocab_size = vocab_size_of(model)
        self.takes_positions = PrefillAdapter(model).takes_positions
        self.pool = ConstantPool()
        self.programs: dict[GraphSignature, GraphProgram] = {}
        self.reports: list[Report] = []
        self.compiles = 0
        self.cache_hits = 0
        self._plan: Optional[BucketPlan] = None
        self._dynamic: dict[tuple[str, bool], Callable] = {}
        self._lock = threading.Lock()  # two threads hitting the same cold bucket compile it once

    @property
    def plan(self) -> BucketPlan:
        if self._plan is None:
            with self._lock:
                if self._plan is None:
                    self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> BucketPlan:
        requested = tuple(self.config.buckets or DEFAULT_BUCKETS)
        buckets = effective_buckets(requested, self.max_positions)
        notes = []
        if buckets != requested:
            notes.append(f"buckets above the model's {self.max_positions} positions were capped to it")
        if self.cache is not None:
            cached = self.cache.load_plan(self.model, self.device, buckets)
            if cached is not None:
                return cached
        plan = analyse_padding(self.model, buckets, self.device, notes)
        if self.cache is not None:
            self.cache.store_plan(self.model, self.device, buckets, plan)
        return plan

    def get(self, signature: GraphSignature) -> GraphProgram:
        program = self.programs.get(signature)
        if program is not None:
            return program
        with self._lock:
            program = self.programs.get(signature)
            if program is None:
                program = self._load_or_compile(signature)
                self.programs[signature] = program
        return program

    def _load_or_compile(self, signature: GraphSignature) -> GraphProgram:
        if self.cache is not None:
            program = self.cache.load_graph(self.model, self.config, signature, self.device)
            if program is not None:
                self.cache_hits += 1
                self.pool.intern_graph(program.gm)
                return program
        program, report = capture_graph(self.model, signature, self.config, self.device)
        self.compiles += 1
        self.reports.append(report)
        self.pool.intern_graph(program.gm)
        if self.cache is not None:
            self.cache.store_graph(self.model, self.config, program, self.device)
        return program

    def dynamic(self, logits: str, kv: bool) -> Callable[[dict], dict]:
        key = (logits, kv)
        if key not in self._dynamic:
            self._dynamic[key] = dynamic_runner(self.model, self.config, logits, kv)
        return self._dynamic[key]
