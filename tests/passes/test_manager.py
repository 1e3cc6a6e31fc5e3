"""The pass manager's promises: order, uuids, and that a raising pass is rolled back, not fatal."""

import torch
import torch.fx as fx

import ttftc
from ttftc.passes.base import GraphPass
from ttftc.passes.manager import PassManager
from ttftc.passes.registry import PIPELINE, pass_names


class _ExplodingPass(GraphPass):
    """Mutates the graph, then raises: the manager must restore the graph from before it."""

    name = "exploding"

    def find(self, gm):
        return [n for n in gm.graph.nodes if n.op == "call_function"]

    def guard(self, gm, match):
        return None

    def replace(self, gm, match):
        match.target = torch.ops.aten.sub.Tensor
        raise RuntimeError("boom")


class _RejectingPass(GraphPass):
    name = "rejecting"

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


# The pipeline order the `order` class attributes gave before the explicit list replaced them (issue 30), with
# kv_inplace after them all (issue 31).
RECORDED_ORDER = ("attention", "rope", "ffn", "norm_linear", "precision", "linear", "kv_inplace")


def test_the_passes_run_in_the_recorded_pipeline_order():
    assert pass_names() == RECORDED_ORDER
    manager = PassManager(ttftc.Config())
    assert tuple(p.name for p in manager.passes) == RECORDED_ORDER
    for p in manager.passes:
        assert len(p.uuid()) == 16
    # A subset still runs in pipeline order, whatever order the Config names it in.
    subset = PassManager(ttftc.Config(passes=("linear", "ffn", "attention")))
    assert [p.name for p in subset.passes] == ["attention", "ffn", "linear"]


def test_every_pass_class_in_the_package_is_in_the_pipeline():
    # A GraphPass defined in ttftc/passes/ but left out of PIPELINE would silently never run.
    import importlib
    import pkgutil

    import ttftc.passes

    defined = set()
    for info in pkgutil.iter_modules(ttftc.passes.__path__):
        module = importlib.import_module(f"ttftc.passes.{info.name}")
        defined |= {obj for obj in vars(module).values() if isinstance(obj, type) and issubclass(obj, GraphPass)
                    and obj is not GraphPass and obj.__module__ == module.__name__}
    assert defined == set(PIPELINE)
