"""The torch.compile backend: capture → passes → codegen → a boxed callable.

`torch.compile(model, backend="ttftc")` finds `ttftc_backend` through the `torch_dynamo_backends` entry point
with the default Config; `ttftc.backend(Config(...))` gives a configured one.

Two hooks let a caller see the graphs of the eager code generator without subclassing the backend (the bucket
capture uses them): `on_aten_graph` gets each functional aten graph before anything rewrites it, `on_lowered`
each graph after the passes and lowering. Either may raise to end the compile there: Dynamo then raises
BackendCompilerFailed with that exception as `inner_exception`, installs nothing and runs nothing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.schemas import MutationType, OutputType
from torch._guards import TracingContext
from torch._subclasses.fake_tensor import unset_fake_temporarily

import ttftc.ops  # noqa: F401  (registers torch.ops.ttftc.*)
from ttftc.capture import (FlatInputs, GraphDescription, GuardWatch, describe_dynamo_graph, flat_inputs,
                           freeze_weights, guards_hold, is_weight, retrace_with_symbolic_lengths, weights_as_attributes)
from ttftc.config import Config
from ttftc.fx_utils import copy_graph
from ttftc.pipeline import run_pipeline
from ttftc.report import Report


def _needs_autograd(example_inputs: Sequence) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    )


@dataclass(frozen=True)
class LoweredGraph:
    """What `on_lowered` receives: one graph the eager code generator will run.

    graph_module: the aten graph after the passes and lowering, the weights frozen into it as constants.
    live_inputs:  the positions, among the flat inputs AOTAutograd passes, of those the graph reads.
    num_inputs:   how many flat inputs AOTAutograd passes (more than Dynamo's where it flattened a tensor
                  subclass, so positions only line up with Dynamo's inputs when the two counts agree).
    """

    graph_module: fx.GraphModule
    live_inputs: tuple[int, ...]
    num_inputs: int


@dataclass(frozen=True)
class CachedGraph:
    """A compiled graph as a graph cache holds it: the lowered aten graph, which of Dynamo's inputs it reads, and the
    guards its compile added to the shape environment (capture.encode_guards), asserted again when it is loaded."""

    graph_module: fx.GraphModule
    live_inputs: tuple[int, ...]
    guards: list
    dynamic_dims: tuple = ()  # per output: the dims marked dynamic for the next graph, or None (_mark_dynamic_outputs)


class GraphCache(Protocol):
    """Where the backend keeps compiled graphs across processes (ttftc.cache.dynamic_graphs implements it)."""

    def load(self, config: Config, description: GraphDescription) -> Sequence[CachedGraph]: ...

    def save(self, config: Config, description: GraphDescription, graph: CachedGraph) -> None: ...


class TtftcBackend:
    """A configured backend. Keeps one Report per graph it compiled, and counts those loaded from `graph_cache`.

    on_aten_graph(aten_gm, num_inputs): called with each functional aten graph AOTAutograd hands over (its
        placeholders are the flat inputs, weights included), before weights are frozen and passes run.
    on_lowered(LoweredGraph): called with each graph once its passes and lowering are done, before it runs
        (again for the graph a new set of weights gets, see _WeightGuard).
    Both are for codegen="eager" (Inductor owns the graph otherwise); either may raise to end the compile.
    graph_cache: where compiled graphs are looked up before compiling, and stored after (codegen="eager"). A hit
        skips AOTAutograd, the passes and lowering; Dynamo has traced the graph already and keeps guarding it. A graph
        is only stored when running it needs nothing AOTAutograd's runtime wrapper would add (no aliased outputs, no
        input mutation outside the graph) and what its compile assumed about sizes can be stated as stored guards.
    """

    def __init__(self, config: Optional[Config] = None, *, autotune_cache=None,
                 on_aten_graph: Optional[Callable[[fx.GraphModule, int], None]] = None,
                 on_lowered: Optional[Callable[[LoweredGraph], None]] = None,
                 graph_cache: Optional[GraphCache] = None):
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"ttftc.backend expects a ttftc.Config, got {type(config).__name__}")
        self.config = config or Config()
        # Where tuned kernel configs are read from (an AutotuneCache); None: the default autotune cache.
        self.autotune_cache = autotune_cache
        self.on_aten_graph = on_aten_graph
        self.on_lowered = on_lowered
        self.reports: list[Report] = []
        self.graph_modules: list[fx.GraphModule] = []  # the lowered graphs, for autotune and inspection
        self.graph_cache = graph_cache
        self.graphs_loaded = 0  # graphs taken from graph_cache instead of compiled (not in `reports`)

    def report(self) -> Report:
        merged = Report()
        for r in self.reports:
            merged.merge(r)
        return merged

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence) -> Callable:
        if _needs_autograd(example_inputs):
            # ttftc compiles inference graphs: freezing weights and fusing would drop gradients. Running
            # Dynamo's graph as is keeps autograd exact.
            warnings.warn(
                "ttftc compiles for inference; this graph runs with grad enabled and trainable inputs, so it "
                "runs uncompiled. Call the model under torch.no_grad() or torch.inference_mode() to use ttftc.",
                stacklevel=2,
            )
            self.reports.append(Report(graphs=1, notes=["graph ran uncompiled: autograd was enabled"]))
            return gm.forward
        if self.config.dynamic_shapes == "auto":
            retrace_with_symbolic_lengths(example_inputs)
        if self.config.codegen == "inductor":
            return self._compile_inductor(gm, example_inputs)
        description = describe_dynamo_graph(gm, example_inputs) if self.graph_cache is not None else None
        # Watched from before the stored variants are tried: a variant whose guard fails here leaves that guard's
        # negation installed, which the compile below may rely on, so the variant it stores must assert it too.
        watch = GuardWatch() if description is not None else None
        if description is not None:
            # One traced graph can compile to several (a pass that decides on a size adds a guard either way), so
            # the cache holds variants: the first whose guards hold here is the one this compile would have made.
            for cached in self.graph_cache.load(self.config, description):
                if guards_hold(cached.guards, description):
                    self.graphs_loaded += 1
                    return _cached_runner(gm, example_inputs, cached)
        inputs = flat_inputs(gm, example_inputs)
        compiled: list[tuple[Callable, Optional[list]]] = []

        def inference_compiler(aten_gm: fx.GraphModule, aot_inputs: Sequence) -> Callable:
            plain = _plain_runtime(len(aot_inputs), len(example_inputs))
            run = self._compile_aten(aten_gm, inputs, len(aot_inputs))
            compiled.append((run, plain))
            return run

        runner = aot_autograd(
            fw_compiler=inference_compiler,
            inference_compiler=inference_compiler,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
        if description is not None and len(compiled) == 1 and compiled[0][1] is not None:
            guards = watch.added(description)
            lowered = getattr(compiled[0][0], "graph_module", None)
            if guards is not None and lowered is not None:
                self.graph_cache.save(self.config, description, CachedGraph(
                    lowered, tuple(compiled[0][0].live_inputs), guards, tuple(compiled[0][1])))
        return runner

    def _compile_aten(self, aten_gm: fx.GraphModule, inputs, num_aot_inputs: int) -> Callable:
        # AOTAutograd calls us inside its FakeTensorMode; passes work on real weights (concatenate, quantize),
        # so the fake mode is lifted here and re-entered only where meta values are computed.
        with unset_fake_temporarily():
            if self.on_aten_graph is not None:
                self.on_aten_graph(aten_gm, num_aot_inputs)
            return self._compile_real(aten_gm, inputs, num_aot_inputs)

    def _compile_real(self, aten_gm: fx.GraphModule, inputs: FlatInputs, num_aot_inputs: int) -> Callable:
        template = fx.GraphModule(aten_gm, copy_graph(aten_gm.graph)) if inputs.weight_indices else None
        run = self._compile_frozen(aten_gm, inputs, num_aot_inputs)
        if template is None or len(run.live_inputs) == num_aot_inputs:
            return run  # nothing was frozen, so nothing can go stale

        def compile_for(args: list) -> Callable:
            gm = fx.GraphModule(template, copy_graph(template.graph))
            return self._compile_frozen(gm, FlatInputs(tuple(args), inputs.weight_indices), len(args))

        return _WeightGuard(inputs.weight_indices, inputs.tensors, run, compile_for)

    def _compile_inductor(self, dynamo_gm: fx.GraphModule, example_inputs: Sequence) -> Callable:
        """The Inductor code generator (ttftc/inductor_pass.py), on a graph that owns the model's weights."""
        from ttftc.inductor_pass import TtftcPostGradPass, compile_with_inductor  # lazy: slow Inductor imports

        weight_indices = frozenset(i for i, x in enumerate(example_inputs) if is_weight(x))

        def compile_for(args: list) -> Callable:
            gm, live = weights_as_attributes(dynamo_gm, args, sorted(weight_indices))
            post_pass = TtftcPostGradPass(self.config, reports=self.reports, autotune_cache=self.autotune_cache)
            reported = len(self.reports)
            compiled = compile_with_inductor(gm, [args[i] for i in live], post_pass)
            if len(self.reports) == reported:
                self.reports.append(Report(graphs=1, notes=[
                    "graph loaded from Inductor's FX graph cache: ttftc's passes did not run in this process, so "
                    "they are not reported (ttftc.explain compiles with that cache off)"]))
            return _select_inputs(compiled, live)

        first = compile_for(list(example_inputs))
        run = _WeightGuard(weight_indices, tuple(example_inputs), first, compile_for) if weight_indices else first
        # Dynamo calls what its backend returns with unpacked arguments (boxing is AOTAutograd's convention).
        return lambda *args: run(list(args))

    def _freeze(self, aten_gm: fx.GraphModule, inputs: FlatInputs, num_aot_inputs: int) -> tuple[list[int], list[str]]:
        """Freeze the weights into `aten_gm`; (the inputs it still reads, the notes for its report)."""
        live, note = freeze_weights(aten_gm, inputs, num_aot_inputs)
        notes = [note] if note else []
        mismatch = _device_mismatch(self.config, inputs)
        if mismatch:
            warnings.warn(mismatch, stacklevel=3)
            notes.append(mismatch)
        return live, notes

    def _compile_frozen(self, aten_gm: fx.GraphModule, inputs: FlatInputs, num_aot_inputs: int) -> Callable:
        live, notes = self._freeze(aten_gm, inputs, num_aot_inputs)
        self.reports.append(run_pipeline(aten_gm, self.config, autotune_cache=self.autotune_cache, notes=notes))
        self.graph_modules.append(aten_gm)
        if self.on_lowered is not None:
            self.on_lowered(LoweredGraph(aten_gm, tuple(live), num_aot_inputs))
        return _boxed(aten_gm, live)


def _device_mismatch(config: Config, inputs: FlatInputs) -> Optional[str]:
    """Lowering follows the tensors; a Config.device that disagrees with them is worth saying, never obeying."""
    if config.device == "auto":
        return None
    found = sorted({t.device.type for t in inputs.tensors if isinstance(t, torch.Tensor)})
    if not found or found == [config.device]:
        return None
    return (f"Config.device={config.device!r} but the graph's tensors are on {', '.join(found)}; ops are lowered "
            f"for the device their tensors are on. Move the model and inputs to {config.device!r}, or use "
            "device='auto'.")


class _WeightGuard:
    """Runs a frozen graph only with the weights it was frozen with; other weights get their own compile.

    Dynamo does not guard on parameter identity: a graph traced inside a repeated layer (after a graph break) is
    reused for every layer, and two instances of one model class share compiled code, each call passing its
    own parameters as inputs. A graph with weights baked in would silently compute with the wrong ones, so
    each call checks that the weight inputs are the very tensors that were frozen (a few hundred `is`
    checks) and compiles a new specialisation, once, for a new set of weights.
    """

    def __init__(self, weight_indices: frozenset[int], inputs: Sequence, first: Callable,
                 compile_for: Callable[[list], Callable]):
        self.weight_indices = tuple(sorted(weight_indices))
        self.compile_for = compile_for  # all inputs (new weights included) -> a boxed runner
        weights = tuple(inputs[i] for i in self.weight_indices)
        self.variants: list[tuple[tuple, Callable]] = [(weights, first)]
        self._boxed_call = True
        self.graph_module = getattr(first, "graph_module", None)
        self.live_inputs = getattr(first, "live_inputs", None)

    def _variant_for(self, args: list) -> Callable:
        weights = tuple(args[i] for i in self.weight_indices)
        for known, runner in self.variants:
            if all(a is b for a, b in zip(known, weights)):
                return runner
        with unset_fake_temporarily():
            runner = self.compile_for(list(args))
        self.variants.append((weights, runner))
        return runner

    def __call__(self, args: list):
        return self._variant_for(args)(args)


def _plain_runtime(num_aot_inputs: int, num_inputs: int) -> Optional[list]:
    """For a graph AOTAutograd is compiling that runs as it is (one input per Dynamo input, outputs that alias
    nothing, every mutation inside the graph, grad mode untouched), the one thing its runtime wrapper still does: the
    dimensions of each output it marks dynamic for the next graph (None for none). None for any other graph: only a
    graph that runs as it is can run from a stored copy without AOTAutograd's wrapper."""
    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if (meta is None or num_aot_inputs != num_inputs or meta.num_intermediate_bases or meta.tokens
            or getattr(meta, "grad_enabled_mutation", None) is not None):
        return None
    plain = (all(o.output_type == OutputType.non_alias for o in meta.output_info)
             and all(not i.mutates_metadata and not i.mutates_storage_metadata
                     and (not i.mutates_data or i.mutation_type == MutationType.MUTATED_IN_GRAPH)
                     for i in meta.input_info))
    if not plain:
        return None
    return [sorted(dims) if (dims := getattr(o, "dynamic_dims", None)) else None for o in meta.output_info]


def _mark_dynamic_outputs(outputs: Sequence, dynamic_dims: Sequence) -> None:
    """What AOTAutograd's wrapper does to a compiled graph's outputs: the dims that were symbolic are marked so that a
    graph Dynamo traces next with them as inputs treats those dims as dynamic from the start (unguarded). Without it a
    loaded graph would steer the next trace elsewhere than the compiled one did (other symbols, another cache key)."""
    for tensor, dims in zip(outputs, dynamic_dims):
        if dims and isinstance(tensor, torch.Tensor):
            marked = getattr(tensor, "_dynamo_propagated_dynamic_indices", None)
            tensor._dynamo_propagated_dynamic_indices = (marked | set(dims)) if marked else set(dims)


def _cached_runner(dynamo_gm: fx.GraphModule, example_inputs: Sequence, cached: CachedGraph) -> Callable:
    """Run a graph loaded from a graph cache on Dynamo's (unpacked) inputs. Its weights are frozen in, so a call with
    other weight tensors (Dynamo does not guard on which parameters it gets, see _WeightGuard) runs Dynamo's own graph
    uncompiled instead: correct, only slower."""
    weight_indices = tuple(i for i, x in enumerate(example_inputs) if is_weight(x))
    weights = tuple(example_inputs[i] for i in weight_indices)
    graph, live, dynamic_dims = cached.graph_module, cached.live_inputs, cached.dynamic_dims

    def run(*args):
        if any(args[i] is not w for i, w in zip(weight_indices, weights)):
            return dynamo_gm(*args)
        outputs = graph(*[args[i] for i in live])
        if dynamic_dims:
            _mark_dynamic_outputs(outputs, dynamic_dims)
        return outputs

    return run


def _select_inputs(compiled: Callable, live: list[int]) -> Callable:
    """A boxed runner over all of Dynamo's inputs that calls `compiled` (unboxed, as compile_fx's result is
    whatever its `_boxed_call` attribute says) with only the `live` ones."""

    def run(args: list):
        picked = [args[i] for i in live]
        args.clear()
        return compiled(*picked)

    run._boxed_call = True  # type: ignore[attr-defined]
    run.live_inputs = tuple(live)  # type: ignore[attr-defined]
    return run


def _boxed(gm: fx.GraphModule, live: list[int]) -> Callable:
    everything_live = live == list(range(len(live)))

    def run(args: list):
        # Boxed convention: we own `args` and clear it so inputs can be freed as early as possible.
        picked = list(args) if everything_live and len(args) == len(live) else [args[i] for i in live]
        args.clear()
        return gm(*picked)

    run._boxed_call = True  # type: ignore[attr-defined]
    run.graph_module = gm  # type: ignore[attr-defined]
    run.live_inputs = tuple(live)  # type: ignore[attr-defined]  (which flat inputs the graph reads)
    return run


def backend(config: Optional[Config] = None) -> TtftcBackend:
    """A backend for `torch.compile(model, backend=ttftc.backend(Config(...)))`."""
    return TtftcBackend(config)


def ttftc_backend(gm: fx.GraphModule, example_inputs: Sequence) -> Callable:
    """The entry-point backend behind `backend="ttftc"`: the default Config."""
    return TtftcBackend()(gm, example_inputs)
