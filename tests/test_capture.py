"""Capture: weights become graph constants, and when AOTAutograd's inputs cannot be mapped back to the model's,
nothing is frozen (the graph still computes with the right weights; passes that need frozen weights step aside)."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

import ttftc
from ttftc import capture, dynamo_backend


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _compile(model, x, config):
    backend = ttftc.backend(config)
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend=backend)(x)
    return actual, expected, backend


def _frozen_buffers(backend) -> list[str]:
    return [name for gm in backend.graph_modules for name, _ in gm.named_buffers() if name.startswith("_frozen_")]


def test_weights_are_frozen_into_the_graph_and_the_linear_pass_takes_them():
    actual, expected, backend = _compile(_TwoLinears().eval(), torch.randn(3, 8), ttftc.Config(passes=("linear",)))
    torch.testing.assert_close(actual, expected)
    assert len(_frozen_buffers(backend)) == 4  # two weights, two biases
    report = backend.report()
    assert report.pass_counts["linear"] == 2 and not any("not frozen" in n for n in report.notes)


def test_unmappable_inputs_fall_back_to_live_weights(monkeypatch):
    """AOTAutograd sees one input more than ttftc's flat list (as when it adds or deduplicates inputs): the index
    mapping is unknown, so every input stays live, the report says so, and the numbers stay eager's."""
    real_flat_inputs = capture.flat_inputs

    def one_more_input_in_front(gm, example_inputs):
        flat = real_flat_inputs(gm, example_inputs)
        # Shifted by one: freezing "by index" now would bake the wrong tensors into the graph.
        return capture.FlatInputs((torch.zeros(1),) + flat.tensors, frozenset(i + 1 for i in flat.weight_indices))

    monkeypatch.setattr(dynamo_backend, "flat_inputs", one_more_input_in_front)
    actual, expected, backend = _compile(_TwoLinears().eval(), torch.randn(3, 8), ttftc.Config(passes=("linear",)))
    torch.testing.assert_close(actual, expected)
    assert _frozen_buffers(backend) == []
    report = backend.report()
    assert any(n.startswith("weights not frozen: AOTAutograd has") for n in report.notes), report.notes
    assert report.pass_counts["linear"] == 0
    assert any("frozen" in r for r in report.rejections["linear"]), report.rejections


def _graph_with_placeholders(n: int) -> fx.GraphModule:
    graph = fx.Graph()
    nodes = [graph.placeholder(f"p{i}") for i in range(n)]
    graph.output(nodes[0] if n == 1 else tuple(nodes))
    return fx.GraphModule(nn.Module(), graph)


def test_freeze_weights_refuses_a_count_mismatch_and_leaves_the_graph_alone():
    w = nn.Parameter(torch.randn(2, 2))
    inputs = capture.FlatInputs((w, torch.randn(2)), frozenset({0}))
    gm = _graph_with_placeholders(3)
    live, note = capture.freeze_weights(gm, inputs, num_aot_inputs=3)
    assert live == [0, 1, 2] and "3 inputs for 2 flat inputs" in note
    assert [n.op for n in gm.graph.nodes] == ["placeholder"] * 3 + ["output"]
    gm = _graph_with_placeholders(2)
    live, note = capture.freeze_weights(gm, inputs, num_aot_inputs=2)
    assert live == [1] and note is None
    assert [n.op for n in gm.graph.nodes] == ["get_attr", "placeholder", "output"]
    assert torch.equal(getattr(gm, gm.graph.find_nodes(op="get_attr")[0].target), w)


def test_a_mutated_weight_stays_an_input():
    graph = fx.Graph()
    weight, x = graph.placeholder("weight"), graph.placeholder("x")
    graph.call_function(torch.ops.aten.copy_.default, (weight, x))
    graph.output(x)
    gm = fx.GraphModule(nn.Module(), graph)
    tensors = (nn.Parameter(torch.zeros(2)), torch.ones(2))
    live, note = capture.freeze_weights(gm, capture.FlatInputs(tensors, frozenset({0})), num_aot_inputs=2)
    assert live == [0, 1] and note is None  # written in place: freezing it would drop the write


def test_flat_inputs_mark_parameters_and_dynamo_module_weights():
    gm = fx.GraphModule(nn.Module(), fx.Graph())
    param, activation, buffer = nn.Parameter(torch.randn(2)), torch.randn(2), torch.randn(2)
    buffer._dynamo_static_input_type = "unguarded"  # how Dynamo marks an inlined module's buffers
    flat = capture.flat_inputs(gm, [activation, param, buffer])
    assert flat.tensors == (activation, param, buffer) and flat.weight_indices == frozenset({1, 2})
    static_cache = torch.randn(2)
    static_cache._dynamo_static_input_type = "guarded"  # mark_static_address: may be mutated, stays an input
    assert not capture.is_weight(static_cache) and capture.is_weight(param)
