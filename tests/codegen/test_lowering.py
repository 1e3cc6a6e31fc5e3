"""Provider choice: first capable by priority, forced providers fall back to the reference, checks never raise."""

import pytest
import torch
import torch.fx as fx

import ttftc.ops  # noqa: F401
from ttftc.codegen import registry
from ttftc.codegen.lowering import choose, lower_graph
from ttftc.codegen.registry import LoweringContext, register_lowering


@pytest.fixture
def isolated_registry(monkeypatch):
    monkeypatch.setattr(registry, "_LOWERINGS", {})  # no real providers: only the test's own


def _gated_ffn_graph():
    def fn(x, wgu, wd):
        return torch.ops.ttftc.gated_ffn.default(x, wgu, wd, act="silu")

    gm = fx.symbolic_trace(fn)
    example = (torch.randn(3, 8), torch.randn(32, 8), torch.randn(8, 16))
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example):
        node.meta["val"] = value
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["val"] = torch.empty(3, 8)
    return gm, example


def test_first_capable_provider_by_priority_wins(isolated_registry):
    calls = []
    register_lowering("gated_ffn", "slowpoke", unsupported_reason=lambda ctx, *a, **k: None, priority=1)(
        lambda *a, **k: calls.append("slowpoke") or torch.ops.ttftc.gated_ffn.default(*a, **k)
    )
    register_lowering("gated_ffn", "fast", unsupported_reason=lambda ctx, *a, **k: "needs a GPU", priority=5)(
        lambda *a, **k: calls.append("fast")
    )
    gm, example = _gated_ffn_graph()
    decisions = lower_graph(gm, provider="auto")
    assert [(d.provider, d.skipped) for d in decisions] == [("slowpoke", ["fast: needs a GPU"])]
    expected = torch.ops.ttftc.gated_ffn(*example, act="silu")
    torch.testing.assert_close(gm(*example), expected)
    assert calls == ["slowpoke"]


def test_forced_provider_that_is_not_capable_takes_the_reference(isolated_registry):
    register_lowering("gated_ffn", "fast", unsupported_reason=lambda ctx, *a, **k: "no", priority=5)(
        lambda *a, **k: None
    )
    gm, example = _gated_ffn_graph()
    (decision,) = lower_graph(gm, provider="fast")
    assert decision.provider == "reference"
    torch.testing.assert_close(gm(*example), torch.ops.ttftc.gated_ffn(*example, act="silu"))


def test_a_raising_capability_check_counts_as_not_capable(isolated_registry):
    def broken(ctx, *args, **kwargs):
        raise KeyError("oops")

    register_lowering("gated_ffn", "broken", unsupported_reason=broken)(lambda *a, **k: None)
    entry, skipped = choose("gated_ffn", LoweringContext("cpu", None), (), {})
    assert entry is None and "KeyError" in skipped[0]


def test_a_failing_prepare_keeps_the_reference(isolated_registry):
    def bad_prepare(gm, node):
        raise RuntimeError("cannot pack")

    register_lowering("gated_ffn", "packer", unsupported_reason=lambda ctx, *a, **k: None, prepare=bad_prepare)(
        lambda *a, **k: None
    )
    gm, example = _gated_ffn_graph()
    (decision,) = lower_graph(gm, provider="auto")
    assert decision.provider == "reference" and "cannot pack" in decision.skipped[0]


def test_registering_for_an_unknown_op_fails_early(isolated_registry):
    with pytest.raises(KeyError, match="no_such_op"):
        register_lowering("no_such_op", "x", unsupported_reason=lambda ctx: None)
