"""fx_utils: the FX helpers every pass (and the lowering, capture and code generators) builds on."""

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ttftc import fx_utils as gu

aten = torch.ops.aten


def _gm_with_meta():
    def fn(x, mask):
        return aten.add.Tensor(x, mask)

    gm = fx.symbolic_trace(fn)
    mode = FakeTensorMode()
    for node, shape in zip([n for n in gm.graph.nodes if n.op == "placeholder"], [(2, 3), (2, 3)]):
        node.meta["val"] = mode.from_tensor(torch.empty(shape))
    return gm


def test_call_fills_meta_from_positional_and_keyword_nodes():
    gm = _gm_with_meta()
    x, mask = [n for n in gm.graph.nodes if n.op == "placeholder"]
    add = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(add):
        node = gu.call(gm, aten.mul.Tensor, (x,), {"other": mask})
    assert tuple(node.meta["val"].shape) == (2, 3)


def test_copy_graph_is_independent_of_the_original():
    gm = _gm_with_meta()
    saved = gu.copy_graph(gm.graph)
    add = next(n for n in gm.graph.nodes if n.op == "call_function")
    add.target = aten.sub.Tensor
    assert [n.target for n in saved.nodes if n.op == "call_function"] == [aten.add.Tensor]
    assert all("val" in n.meta for n in saved.nodes if n.op == "placeholder")


def test_transposed_constant_and_static_int():
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    weight = torch.randn(4, 3)
    gm.register_buffer("w", weight)
    w_node = gm.graph.get_attr("w")
    t_node = gm.graph.call_function(aten.t.default, (w_node,))
    assert gu.transposed_constant(gm, t_node) is weight
    assert gu.constant_value(gm, w_node) is weight
    assert gu.static_int(5) == 5 and gu.static_int(True) is None
