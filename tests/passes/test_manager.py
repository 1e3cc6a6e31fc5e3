"""The pass manager's promises: order, uuids, and that a raising pass is rolled back, not fatal."""

import torch
import torch.fx as fx

import ttftc
from ttftc.passes.base import GraphPass
from ttftc.passes.manager import PassManager


class _ExplodingPass(GraphPass):
    """Mutates the graph, then raises: the manager must restore the graph from before it."""

    name = "exploding"
    order = 99

    def find(self, gm):
        return [n for n in gm.graph.nodes if n.op == "call_function"]

    def guard(self, gm, match):
        return None

    def replace(self, gm, match):
        match.target = torch.ops.aten.sub.Tensor
        raise RuntimeError("boom")


class _RejectingPass(GraphPass):
    name = "rejecting"
    order = 98

    def find(self, gm):
        return [n for n in gm.graph.nodes if n.op == "call_function"]

    def guard(self, gm, match):
        return f"{match.name}: cannot prove it safe"

    def replace(self, gm, match):
        raise AssertionError("a rejected match must never be replaced")


def _graph_module():
    def fn(x, y):
        return torch.ops.aten.add.Tensor(x, y)

    return fx.symbolic_trace(fn)


def test_a_raising_pass_is_recorded_and_rolled_back():
    gm = _graph_module()
    manager = PassManager(ttftc.Config(passes=()))
    manager.passes = [_ExplodingPass(manager.config)]
    stats = manager.run(gm)
    assert stats[0].error and "boom" in stats[0].error and stats[0].matched == 0
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.aten.add.Tensor]
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(gm(x, y), x + y)


def test_rejections_are_counted_with_reasons_and_change_nothing():
    gm = _graph_module()
    manager = PassManager(ttftc.Config(passes=()))
    manager.passes = [_RejectingPass(manager.config)]
    (stats,) = manager.run(gm)
    assert stats.candidates == 1 and stats.matched == 0
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert stats.rejections == [f"{node.name}: cannot prove it safe"]
    assert node.target is torch.ops.aten.add.Tensor


def test_uuid_is_stable_and_depends_on_config():
    a = PassManager(ttftc.Config()).uuid()
    assert a == PassManager(ttftc.Config()).uuid()
    assert a != PassManager(ttftc.Config(precision="bf16")).uuid()


def test_registered_passes_run_in_pipeline_order():
    manager = PassManager(ttftc.Config())
    orders = [p.order for p in manager.passes]
    assert orders == sorted(orders)
    for p in manager.passes:
        assert len(p.uuid()) == 16
