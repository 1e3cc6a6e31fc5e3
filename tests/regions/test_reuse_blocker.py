"""What keeps a compiled region from being rebound to another block's weights (regions/compile.py)."""

import functools

import torch
import torch.fx as fx

from ttftc.regions.compile import bind, reuse_blocker


def _module(target, buffer=None) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    root = torch.nn.Module()
    args = (x,)
    if buffer is not None:
        root.register_buffer("w", buffer, persistent=False)
        args = (x, graph.get_attr("w"))
    graph.output(graph.call_function(target, args))
    return fx.GraphModule(root, graph)


def test_buffers_read_through_get_attr_are_rebindable():
    gm = _module(torch.add, torch.ones(3))
    assert reuse_blocker(gm) is None
    other = bind(gm, {"w": torch.full((3,), 2.0)})
    x = torch.zeros(3)
    assert torch.equal(other(x), torch.full((3,), 2.0)) and torch.equal(gm(x), torch.ones(3))


def test_a_target_that_carries_a_tensor_is_not_rebindable():
    weight = torch.ones(3)

    def captured(x):
        return x + weight

    add_weight = functools.partial(torch.add, other=weight)
    add_weight.__name__ = "add_weight"  # fx names nodes after their target
    assert "holds a tensor" in reuse_blocker(_module(add_weight))
    assert "holds a tensor" in reuse_blocker(_module(captured))
