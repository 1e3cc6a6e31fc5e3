"""Capture one prefill graph per bucket shape, as a plain aten GraphModule that runs without Dynamo.

Dynamo traces a small adapter around the model (tensors in, a flat tuple of tensors out), AOTAutograd turns it
into the functional aten graph, and the ttftc backend runs its passes and lowering on it. The backend's
`on_lowered` hook then keeps the transformed aten graph and stops the compile by raising: Dynamo installs no
cache entry and never runs the graph. Calling that graph directly is what makes the serving path free of
recompiles: there is no guard to fail and no frame to re-trace, whatever length comes in.
"""

from __future__ import annotations

import inspect
import re
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch._dynamo.exc import BackendCompilerFailed

from ttftc.dynamo_backend import LoweredGraph, TtftcBackend
from ttftc.buckets.plan import BucketPlan, plan_from_graph, refused
from ttftc.buckets.program import GraphProgram, GraphSignature, output_names
from ttftc.config import Config
from ttftc.report import Report

# Not mutated (mutation testing): Dynamo traces it in forward, where a trampoline's bookkeeping breaks the graph.
def _model_outputs(out, *, kv: bool) -> list[torch.Tensor]:  # pragma: no mutate block
    if isinstance(out, torch.Tensor):
        return [out]
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0]  # a base model: the last hidden state stands in for logits
    flat = [logits]
    if not kv:
        return flat
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        return flat
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            flat += [layer.keys, layer.values]
    else:
        for keys, values in cache:
            flat += [keys, values]
    return flat


class PrefillAdapter(torch.nn.Module):
    """model(input_ids, position_ids) as a function of tensors returning a flat tuple, so one graph holds it all."""

    def __init__(self, model: torch.nn.Module, *, logits: str = "all", kv: bool = True):
        super().__init__()
        self.model = model
        self.logits = logits
        self.kv = kv
        params = inspect.signature(model.forward).parameters
        self.takes_positions = "position_ids" in params
        self.takes_logits_to_keep = "logits_to_keep" in params
        self.takes_use_cache = "use_cache" in params

    # Not mutated (mutation testing): mutmut's trampoline takes (*args, **kwargs), renaming Dynamo's inputs.
    def forward(self, input_ids, position_ids=None, last_index=None):  # pragma: no mutate block
        kwargs = {}
        if self.takes_positions:
            kwargs["position_ids"] = position_ids
        if self.takes_use_cache:
            kwargs["use_cache"] = self.kv
        last = self.logits == "last"
        if last and self.takes_logits_to_keep:
            # HF keeps hidden[:, last_index]: [B, B, V]; sequence b's row is the diagonal entry.
            kwargs["logits_to_keep"] = last_index
        flat = _model_outputs(self.model(input_ids=input_ids, **kwargs), kv=self.kv)
        if last:
            rows = torch.arange(input_ids.shape[0], device=input_ids.device)
            cols = rows if self.takes_logits_to_keep else last_index
            flat[0] = flat[0][rows, cols].unsqueeze(1)
        return tuple(flat)


def example_inputs(signature: GraphSignature, device: torch.device, adapter: PrefillAdapter) -> dict:
    b, s = signature.batch, signature.bucket
    tensors = {"input_ids": torch.zeros(b, s, dtype=torch.long, device=device)}
    if adapter.takes_positions:
        tensors["position_ids"] = torch.arange(s, device=device).expand(b, s).contiguous()
    if signature.logits == "last":
        tensors["last_index"] = torch.full((b,), s - 1, dtype=torch.long, device=device)
    return tensors


class _Captured(Exception):
    """Raised by the capture backend to end the compile once it has what it needs."""


_SOURCE = re.compile(r"^L\['(\w+)'\]$")


class _CaptureBackend:
    """The ttftc backend, plus: remembers which graph input is which, and stops once it has what it needs.

    observe(aten_gm, names) sees the functional aten graph before any rewrite; with compile_graph the graph is
    also compiled and kept (graph, live). Either way the compile ends there, through the backend's hooks.
    """

    def __init__(self, config: Config, *, observe: Optional[Callable] = None, compile_graph: bool = True):
        # The capture decides itself which sizes are symbolic (a static bucket, or the plan's symbolic length).
        self.backend = TtftcBackend(config.replace(dynamic_shapes="dynamo"), on_aten_graph=self._on_aten_graph,
                                    on_lowered=self._on_lowered)
        self.observe = observe
        self.compile_graph = compile_graph
        self.flat_names: list[Optional[str]] = []
        self.graph: Optional[fx.GraphModule] = None
        self.live: tuple[int, ...] = ()
        self.aot_input_count: Optional[int] = None

    def report(self) -> Report:
        return self.backend.report()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence) -> Callable:
        own = len(dict(gm.named_parameters(remove_duplicate=False)))
        own += len(dict(gm.named_buffers(remove_duplicate=False)))
        names: list[Optional[str]] = [None] * own
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                arg = node.meta.get("grapharg")
                match = _SOURCE.match(arg.source.name) if arg is not None and arg.source is not None else None
                names.append(match.group(1) if match else None)
        self.flat_names = names
        return self.backend(gm, example_inputs)

    def _on_aten_graph(self, aten_gm: fx.GraphModule, num_aot_inputs: int) -> None:
        if self.observe is not None:
            names = self.flat_names if num_aot_inputs == len(self.flat_names) else [None] * num_aot_inputs
            self.observe(aten_gm, names)
        if not self.compile_graph:
            raise _Captured()

    def _on_lowered(self, lowered: LoweredGraph) -> None:
        self.aot_input_count = lowered.num_inputs
        self.graph = lowered.graph_module
        self.live = lowered.live_inputs
        raise _Captured()


def _trace(adapter: PrefillAdapter, backend: _CaptureBackend, tensors: dict, *, dynamic: bool) -> None:
    compiled = torch.compile(adapter, backend=backend, fullgraph=True, dynamic=None if dynamic else False)
    try:
        with torch.no_grad():
            compiled(**tensors)
    except BackendCompilerFailed as exc:
        if isinstance(exc.inner_exception, _Captured):
            return
        raise
    raise RuntimeError("the capture backend was never called: Dynamo produced no graph for the model")


def capture_graph(model: torch.nn.Module, signature: GraphSignature, config: Config,
                  device: torch.device) -> tuple[GraphProgram, Report]:
    """Trace, transform and lower the prefill graph for one signature. Costs one compile; runs nothing."""
    adapter = PrefillAdapter(model, logits=signature.logits, kv=signature.kv)
    backend = _CaptureBackend(config)
    tensors = example_inputs(signature, device, adapter)
    _trace(adapter, backend, tensors, dynamic=False)  # returns only once the backend has compiled a graph
    if backend.aot_input_count != len(backend.flat_names):
        # AOTAutograd flattens a tensor subclass (e.g. a quantised weight) into several inputs, so its positions no
        # longer line up with Dynamo's, and naming them by position could feed one prompt tensor as another.
        raise RuntimeError(
            f"the prefill graph takes {backend.aot_input_count} inputs after AOTAutograd where Dynamo's took "
            f"{len(backend.flat_names)}, so ttftc cannot tell which prompt tensor each one is. Tensor subclasses "
            "(e.g. quantised weights) cause this: use plain tensors, or Config(buckets=None)."
        )
    names = [backend.flat_names[i] for i in backend.live]
    if any(n not in tensors for n in names):
        raise RuntimeError(
            f"the prefill graph reads inputs other than the prompt tensors ({names}); it cannot run without "
            "Dynamo. This happens when a model keeps mutable state (e.g. a static cache) inside the module, or reads "
            "a tensor from a global variable: register such a tensor as a buffer of the model, or use "
            "Config(buckets=None)."
        )
    gm = backend.graph
    _drop_unused_constants(gm)
    outputs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    program = GraphProgram(signature, gm, names, output_names(len(outputs)))
    return program, backend.report()


def _drop_unused_constants(gm: fx.GraphModule) -> None:
    """Remove constants no node reads any more (e.g. a weight a lowering replaced by its transpose)."""
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [name for name, _ in gm.named_buffers(recurse=False) if name not in used]:
        del gm._buffers[name]
    gm.recompile()


def analyse_padding(model: torch.nn.Module, buckets: tuple[int, ...], device: torch.device,
                    notes: Sequence[str] = ()) -> BucketPlan:
    """Trace the model once with a symbolic sequence length and run the padding-safety analysis on it."""
    adapter = PrefillAdapter(model, logits="all", kv=True)
    length = 8  # any length > 1: Dynamo specialises sizes 0 and 1
    tensors = example_inputs(GraphSignature(length), device, adapter)
    for t in tensors.values():
        torch._dynamo.maybe_mark_dynamic(t, t.dim() - 1)
    plans: list[BucketPlan] = []

    def observe(aten_gm: fx.GraphModule, names: list) -> None:
        placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
        seq = set()
        for node, name in zip(placeholders, names):
            value = node.meta.get("val")
            if name in ("input_ids", "position_ids") and isinstance(value, torch.Tensor) and value.dim() >= 2:
                size = value.shape[-1]
                if isinstance(size, torch.SymInt):
                    seq |= set(size.node.expr.free_symbols)
        if not any(n in ("input_ids",) for n in names):
            plans.append(refused(buckets, "could not find the token ids among the graph inputs", notes))
            return
        plans.append(plan_from_graph(aten_gm, seq, buckets, notes))

    try:
        _trace(adapter, _CaptureBackend(Config(passes=()), observe=observe, compile_graph=False), tensors,
               dynamic=True)
    except Exception as exc:  # a model Dynamo cannot trace as one graph cannot be bucketed either
        return refused(buckets, f"tracing with a symbolic length failed: {type(exc).__name__}: {exc}"[:500], notes)
    if not plans:
        return refused(buckets, "Dynamo handed over no graph to analyse", notes)
    return plans[0]
