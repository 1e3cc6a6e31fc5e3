"""Capture: Dynamo's torch-level FX graph → a functional aten inference graph with weights frozen as constants.

Dynamo lifts parameters and buffers to graph inputs and marks them static. Freezing them into the aten graph as
`get_attr` constants lets a pass transform a weight once at compile time (concatenate, transpose, quantize)
instead of on every call. Like Inductor's freezing, this assumes weights do not change after compile: recompile
after loading new weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx
from torch._dynamo import symbolic_convert

from ttftc.fx_utils import copy_graph

aten = torch.ops.aten


def is_weight(x) -> bool:
    # "unguarded" is how Dynamo marks the parameters and buffers of inlined nn.Modules. Tensors marked with
    # mark_static_address (e.g. a StaticCache) are "guarded" and may be mutated, so they stay inputs.
    return isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None) == "unguarded"


@dataclass(frozen=True)
class FlatInputs:
    """The inputs AOTAutograd will flatten, in its order, and which of them are weights."""

    tensors: tuple
    weight_indices: frozenset[int]


def flat_inputs(dynamo_gm: fx.GraphModule, example_inputs: Sequence) -> FlatInputs:
    # aot_module_simplified puts the module's own parameters and buffers first (non-empty only when Dynamo did
    # not lift them), then the user inputs.
    own = {
        **dict(dynamo_gm.named_parameters(remove_duplicate=False)),
        **dict(dynamo_gm.named_buffers(remove_duplicate=False)),
    }
    flat = tuple(own.values()) + tuple(example_inputs)
    weights = set(range(len(own)))
    weights.update(len(own) + i for i, x in enumerate(example_inputs) if is_weight(x))
    return FlatInputs(flat, frozenset(weights))


def freeze_weights(aten_gm: fx.GraphModule, inputs: FlatInputs, num_aot_inputs: int) -> tuple[list[int], str | None]:
    """Turn weight placeholders into constants, in place. Returns (indices of inputs still read, note)."""
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    if num_aot_inputs != len(inputs.tensors) or len(placeholders) != num_aot_inputs:
        # AOTAutograd deduplicated or added inputs; the index mapping is unknown, so nothing is frozen and
        # passes that need constant weights reject their matches.
        return list(range(num_aot_inputs)), (
            f"weights not frozen: AOTAutograd has {num_aot_inputs} inputs for {len(inputs.tensors)} flat inputs"
        )
    live = []
    for index, node in enumerate(placeholders):
        tensor = inputs.tensors[index]
        mutated = any(u.target is aten.copy_.default and u.args[0] is node for u in node.users)
        if index not in inputs.weight_indices or mutated or not isinstance(tensor, torch.Tensor):
            live.append(index)
            continue
        name = f"_frozen_{index}_{node.name}"
        aten_gm.register_buffer(name, tensor.detach(), persistent=False)
        with aten_gm.graph.inserting_before(node):
            const = aten_gm.graph.get_attr(name)
        const.meta.update(node.meta)
        node.replace_all_uses_with(const)
        aten_gm.graph.erase_node(node)
    # get_attr nodes must precede their users; placeholders came first, so they already do.
    aten_gm.graph.lint()
    aten_gm.recompile()
    return live, None


def weights_as_attributes(dynamo_gm: fx.GraphModule, inputs: Sequence,
                          weight_indices: Sequence[int]) -> tuple[fx.GraphModule, list[int]]:
    """A copy of Dynamo's graph that holds `inputs[i]` for i in `weight_indices` as module buffers read through
    get_attr, and the indices of the inputs it still takes.

    Dynamo lifts an inlined module's parameters to graph inputs; Inductor's freezing only folds tensors the graph
    module owns. Handing them back to the module is what lets Inductor freeze them, whatever Dynamo's settings
    were while it traced.
    """
    gm = fx.GraphModule(dynamo_gm, copy_graph(dynamo_gm.graph))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    chosen = set(weight_indices)
    live = []
    for index, node in enumerate(placeholders):
        if index not in chosen:
            live.append(index)
            continue
        name = f"_ttftc_weight_{index}"
        gm.register_buffer(name, inputs[index].detach(), persistent=False)
        with gm.graph.inserting_after(placeholders[-1]):  # placeholders stay first
            attr = gm.graph.get_attr(name)
        attr.meta.update(node.meta)
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm, live


def retrace_with_symbolic_lengths(example_inputs: Sequence) -> None:
    """Make Dynamo trace this frame again, now, with symbolic lengths, when that changes anything; else return.

    This is what Dynamo's automatic dynamic shapes does at the second distinct prompt length, done at the first:
    every dimension above 1 of a non-weight tensor input (the prompt length, a KV cache's past length), the batch
    dimension excepted, is marked `maybe_mark_dynamic`, so a weight-pinned size (the hidden size) or a size the model branches on specialises
    back to a constant during the retrace, and the frame restarts. A model compiled this way never compiles again
    for a new prompt length, where the static first graph would be thrown away at the next length and compiled again
    (benchmarks/README.md, start-up).

    The restart uses two Dynamo internals, checked for and skipped (compiling the static graph) when missing: the
    one restart exception that Dynamo lets a backend raise (its float-tensorify pass uses it the same way), and
    clearing the speculation log, as Dynamo does itself before a restart whose retrace may take another path.
    """
    if _has_symbolic_sizes(example_inputs) or not _mark_lengths_dynamic(example_inputs):
        return
    restart = getattr(torch._dynamo.exc, "TensorifyScalarRestartAnalysis", None)
    try:
        tx = symbolic_convert.InstructionTranslator.current_tx()
        speculation_log = tx.speculation_log
    except (ImportError, AttributeError, AssertionError):
        return
    if restart is None or not hasattr(speculation_log, "clear"):
        return
    speculation_log.clear()
    raise restart(restart_reason="ttftc: retrace with symbolic sequence lengths")


def _mark_lengths_dynamic(example_inputs: Sequence) -> bool:
    marked = False
    for x in example_inputs:
        if not isinstance(x, torch.Tensor) or is_weight(x) or isinstance(x, torch._subclasses.FakeTensor):
            continue
        already = getattr(x, "_dynamo_weak_dynamic_indices", set()) | getattr(x, "_dynamo_dynamic_indices", set())
        first = 1 if x.dim() >= 2 else 0  # the batch stays static: a new batch size is Dynamo's to handle
        for dim, size in enumerate(x.shape):
            if dim >= first and isinstance(size, int) and size > 1 and dim not in already:
                torch._dynamo.maybe_mark_dynamic(x, dim)
                marked = True
    return marked


def _has_symbolic_sizes(example_inputs: Sequence) -> bool:
    return any(isinstance(x, torch.SymInt) for x in example_inputs) or any(
        isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape) for x in example_inputs
    )
