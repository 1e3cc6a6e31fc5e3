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

aten = torch.ops.aten


def _is_weight(x) -> bool:
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
    weights.update(len(own) + i for i, x in enumerate(example_inputs) if _is_weight(x))
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
