"""The graph file format on a small hand-built graph: round trips (with a tuned config), what the encoder refuses,
and what the decoder resolves and imports. The hostile cases, written as attacks, are in tests/security/."""

import importlib
import operator

import pytest
import torch
import torch.fx as fx

from ttftc.buckets.program import GraphProgram, GraphSignature
from ttftc.cache.graph_format import GraphFormatError, decode_program, encode_program, parse_program
from ttftc.codegen.cpu.linear import linear_cpu

SIGNATURE = GraphSignature(4, 1, "all", False)
VOCAB, WIDTH = 10, 6


def _program(target=linear_cpu, kwargs=None) -> tuple[GraphProgram, dict]:
    """input_ids -> embedding -> * 2.0 -> split in two -> [0] -> linear: logits."""
    root = torch.nn.Module()
    weights = {"table": torch.randn(VOCAB, WIDTH), "head": torch.randn(VOCAB, WIDTH)}
    for key, tensor in weights.items():
        root.register_buffer(key, tensor)
    graph = fx.Graph()
    ids = graph.placeholder("input_ids")
    x = graph.call_function(torch.ops.aten.embedding.default, (graph.get_attr("table"), ids))
    x = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    parts = graph.call_function(torch.ops.aten.split.Tensor, (x, 4, 1))
    x = graph.call_function(operator.getitem, (parts, 0))
    logits = graph.call_function(target, (x, graph.get_attr("head")), kwargs or {})
    graph.output((logits,))
    return GraphProgram(SIGNATURE, fx.GraphModule(root, graph), ["input_ids"], ["logits"]), weights


def _keyed(weights: dict):
    by_id = {id(t): k for k, t in weights.items()}
    return lambda t: by_id[id(t)]


def test_round_trip_with_a_tuned_config_computes_the_same():
    program, weights = _program(kwargs={"tuning_config": {"num_threads": 1, "gemm": "blas", "n_block": 512}})
    data = encode_program(program, _keyed(weights))
    loaded = decode_program(data, weights.__getitem__)
    ids = torch.tensor([[1, 2, 3, 9]])
    assert torch.equal(loaded({"input_ids": ids})["logits"], program({"input_ids": ids})["logits"])
    assert loaded.signature == SIGNATURE and loaded.inputs == ("input_ids",)


@pytest.mark.parametrize("config", [{"gemm": "fastest"}, {"n_block": "512"}, {"num_threads": True},
                                    {"no_such_knob": 1}, {"gemm": ["blas"]}])
def test_a_tuned_config_must_be_a_point_of_the_lowerings_search_space(config):
    program, weights = _program(kwargs={"tuning_config": config})
    with pytest.raises(GraphFormatError, match="tuning_config"):
        encode_program(program, _keyed(weights))


def test_the_encoder_refuses_a_target_off_the_allow_list():
    program, weights = _program(target=torch.nn.functional.linear)
    with pytest.raises(GraphFormatError, match="not an aten/ttftc op, operator.getitem or a registered ttftc lowering"):
        encode_program(program, _keyed(weights))


def test_the_encoder_refuses_what_the_decoder_would_refuse():
    program, weights = _program(kwargs={"no_such_knob": 1})
    with pytest.raises(GraphFormatError, match="the graph cannot be saved: .*'no_such_knob'"):
        encode_program(program, _keyed(weights))
    program, weights = _program()
    program.gm.add_submodule("sub", torch.nn.Module())
    program.gm.sub.register_buffer("w", torch.randn(VOCAB, WIDTH))
    head = next(n for n in program.gm.graph.nodes if n.op == "get_attr" and n.target == "head")
    head.target = "sub.w"  # a nested constant: its name is not an identifier
    weights["w"] = program.gm.sub.w
    with pytest.raises(GraphFormatError, match="'sub.w' is not a plain Python identifier"):
        encode_program(program, _keyed(weights))


def test_decoding_imports_only_the_provider_module_a_lowering_names(monkeypatch):
    program, weights = _program()
    data = encode_program(program, _keyed(weights))
    imported = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: (imported.append(name), real(name, *a))[1])
    from ttftc.cache import graph_calls

    graph_calls._resolve_function.cache_clear()
    parse_program(data, weights.__getitem__)
    assert imported == ["ttftc.codegen.cpu.linear"] or imported == []  # [] when already resolved in this process
    assert not any("triton" in name for name in imported)


def test_parse_checks_before_build_and_build_is_separate():
    program, weights = _program()
    spec = parse_program(encode_program(program, _keyed(weights)), weights.__getitem__)
    assert spec.signature == SIGNATURE and len(spec.nodes) == 9
    assert torch.equal(spec.build()({"input_ids": torch.tensor([[0, 1, 2, 3]])})["logits"],
                       program({"input_ids": torch.tensor([[0, 1, 2, 3]])})["logits"])


def test_a_constant_of_the_wrong_shape_or_layout_is_refused():
    program, weights = _program()
    data = encode_program(program, _keyed(weights))
    with pytest.raises(GraphFormatError, match="stored tensor is .* the graph wants"):
        parse_program(data, {"table": torch.randn(3, 3), "head": weights["head"]}.__getitem__)
    data["constants"]["head"]["stride"] = [1 << 40, 1]  # would make empty_strided ask for terabytes
    with pytest.raises(GraphFormatError, match="do not lay out a dense tensor"):
        parse_program(data, weights.__getitem__)
