"""What the precision rewrites share: dtype casts placed once per producer, constants converted at compile time,
and tuple outputs re-pointed at their replacements."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from ttftc import fx_utils as gu

aten = torch.ops.aten

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class Casts:
    """Dtype casts for one pass over one graph: each (node, dtype) is cast once, right after its producer."""

    def __init__(self):
        self._cache: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}

    def cast(self, gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype) -> fx.Node:
        if gu.dtype_of(node) == dtype:
            return node
        key = (node, dtype)
        if key not in self._cache:
            # Right after the producer, so one cast serves every consumer wherever they sit.
            with gm.graph.inserting_after(node):
                self._cache[key] = gu.call(gm, aten._to_copy.default, (node,), {"dtype": dtype})
        return self._cache[key]

    def const_like(self, gm: fx.GraphModule, node: Optional[fx.Node], dtype: torch.dtype, hint: str):
        """A frozen argument converted to `dtype` (a new constant), or a cast node for a live one."""
        if node is None:
            return None
        value = gu.constant_value(gm, node)
        if value is None:
            return self.cast(gm, node, dtype)
        if value.dtype == dtype or not value.is_floating_point():
            return node
        return gu.add_constant(gm, hint, value.to(dtype))

    @staticmethod
    def restore(gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype) -> fx.Node:
        """`node` back in the dtype the replaced node produced (a new cast right here, where it is needed)."""
        return node if gu.dtype_of(node) == dtype else gu.call(gm, aten._to_copy.default, (node,), {"dtype": dtype})


def rewire_tuple(old: fx.Node, outputs: dict[int, Optional[fx.Node]]) -> None:
    """Point the getitem users of a tuple-returning node at replacement nodes; the old node then dies in DCE."""
    for index, users in gu.getitem_users(old).items():
        for user in users:
            replacement = outputs.get(index)
            if replacement is None:
                raise ValueError(f"output {index} of {old.name} is read but has no replacement")
            user.replace_all_uses_with(replacement)


def is_cast_to(node: Any, dtype: torch.dtype) -> bool:
    """A plain `.to(dtype)` as the rewrites emit it (and as PT2E/torchao graphs spell their integer casts)."""
    return gu.is_call(node, aten._to_copy.default) and set(node.kwargs) == {"dtype"} and node.kwargs["dtype"] == dtype

