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


# ---- behaviours pinned for mutation testing (issue 17): the exact encoding, every refusal with its message ---------

import copy  # noqa: E402
import math  # noqa: E402

from ttftc.cache import graph_format as gf  # noqa: E402
from ttftc.cache.graph_calls import TENSOR, Ref  # noqa: E402
from ttftc.cache.schema import SchemaError  # noqa: E402

_IDENTIFIER_RULE = "is not a plain Python identifier (ASCII, not a keyword, no leading '__', not self/torch)"
_OUTPUT_RULE = "the output node must return one tensor node per declared output (1)"
# What encode_program writes for _program(): the file format itself, field by field.
ENCODED = {
    "format": 1,
    "signature": {"bucket": 4, "batch": 1, "logits": "all", "kv": False},
    "inputs": ["input_ids"],
    "outputs": ["logits"],
    "nodes": [
        {"name": "input_ids", "op": "placeholder"},
        {"name": "table", "op": "get_attr", "target": "table"},
        {"name": "embedding_default", "op": "call_function", "target": {"op": "aten::embedding.default"},
         "args": {"tuple": [{"node": "table"}, {"node": "input_ids"}]}, "kwargs": {"dict": {}}},
        {"name": "mul_tensor", "op": "call_function", "target": {"op": "aten::mul.Tensor"},
         "args": {"tuple": [{"node": "embedding_default"}, 2.0]}, "kwargs": {"dict": {}}},
        {"name": "split_tensor", "op": "call_function", "target": {"op": "aten::split.Tensor"},
         "args": {"tuple": [{"node": "mul_tensor"}, 4, 1]}, "kwargs": {"dict": {}}},
        {"name": "getitem", "op": "call_function", "target": {"fn": "_operator:getitem"},
         "args": {"tuple": [{"node": "split_tensor"}, 0]}, "kwargs": {"dict": {}}},
        {"name": "head", "op": "get_attr", "target": "head"},
        {"name": "linear_cpu", "op": "call_function", "target": {"fn": "ttftc.codegen.cpu.linear:linear_cpu"},
         "args": {"tuple": [{"node": "getitem"}, {"node": "head"}]}, "kwargs": {"dict": {}}},
        {"name": "output", "op": "output", "args": {"tuple": [{"tuple": [{"node": "linear_cpu"}]}]},
         "kwargs": {"dict": {}}},
    ],
    "constants": {
        "table": {"key": "table", "shape": [10, 6], "stride": [6, 1], "dtype": "float32"},
        "head": {"key": "head", "shape": [10, 6], "stride": [6, 1], "dtype": "float32"},
    },
}


def test_the_encoding_is_exactly_the_file_format():
    program, weights = _program()
    assert encode_program(program, _keyed(weights)) == ENCODED


def test_parse_returns_every_checked_part():
    program, weights = _program()
    spec = parse_program(copy.deepcopy(ENCODED), weights.__getitem__)
    assert (spec.signature, spec.inputs, spec.outputs) == (SIGNATURE, ("input_ids",), ("logits",))
    assert [(n.kind, n.name) for n in spec.nodes] == [(e["op"], e["name"]) for e in ENCODED["nodes"]]
    assert spec.nodes[1].target == "table" and spec.nodes[2].target is torch.ops.aten.embedding.default
    assert [r.name for r in spec.nodes[2].args] == ["table", "input_ids"] and spec.nodes[2].kwargs == {}
    assert spec.nodes[4].args[1:] == (4, 1)
    assert [r.name for r in spec.nodes[-1].args[0]] == ["linear_cpu"]
    assert set(spec.constants) == {"table", "head"}
    assert spec.constants["head"].tensor is weights["head"] and spec.constants["head"].stride == (6, 1)
    built = spec.build()
    assert built.signature == SIGNATURE and (built.inputs, built.outputs) == (("input_ids",), ("logits",))
    assert set(dict(built.gm.named_buffers())) == {"table", "head"}
    assert [n.op for n in built.gm.graph.nodes] == [e["op"] for e in ENCODED["nodes"]]


def _set(path, value):
    def mutate(data):
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value
    return mutate


def _drop(path):
    def mutate(data):
        for key in path[:-1]:
            data = data[key]
        del data[path[-1]]
    return mutate


def _node(name, key, value):
    def mutate(data):
        next(n for n in data["nodes"] if n["name"] == name)[key] = value
    return mutate


def _rename_constant(new):
    def mutate(data):
        data["constants"][new] = data["constants"].pop("head")
    return mutate


_REFUSALS = {
    "format": (_set(["format"], 2), "graph format 2; this ttftc reads format 1"),
    "no format": (_drop(["format"]), "graph format None; this ttftc reads format 1"),
    "extra field": (_set(["extra"], 1), "a graph has exactly the fields ['constants', 'format', 'inputs', 'nodes', "
                    "'outputs', 'signature'], got ['constants', 'extra', 'format', 'inputs', 'nodes', 'outputs', "
                    "'signature']"),
    "signature": (_set(["signature", "bucket"], "4"),
                  "ValueError: graph signature field 'bucket' must be int, got '4'"),
    "inputs type": (_set(["inputs"], "input_ids"), "SchemaError: field 'inputs' must be a list, got 'input_ids'"),
    "input name": (_set(["inputs"], ["input_ids", "bogus"]), "SchemaError: field 'inputs[1]' must be one of "
                   "'input_ids', 'position_ids', 'last_index', got 'bogus'"),
    "input twice": (_set(["inputs"], ["input_ids", "input_ids"]),
                    "inputs ['input_ids', 'input_ids'] must name input_ids and each input at most once"),
    "no input_ids": (_set(["inputs"], ["position_ids"]),
                     "inputs ['position_ids'] must name input_ids and each input at most once"),
    "outputs type": (_set(["outputs"], "logits"), "SchemaError: field 'outputs' must be a list, got 'logits'"),
    "output name type": (_set(["outputs"], [5]), "SchemaError: field 'outputs[0]' must be a string, got 5"),
    "output names": (_set(["outputs"], ["wrong"]), "outputs must be ['logits'], got ['wrong']"),
    "no outputs": (_set(["outputs"], []), "a prefill graph returns logits plus key/value pairs; got 0 outputs"),
    "constants type": (_set(["constants"], []), "SchemaError: field 'constants' must be a JSON object, got []"),
    "constant name": (_rename_constant("1x"), f"constant '1x' {_IDENTIFIER_RULE}"),
    "constant module attribute": (_rename_constant("training"),
                                  "constant name 'training' is an attribute every torch.nn.Module has"),
    "constant entry type": (_set(["constants", "head"], 5),
                            "SchemaError: field 'constants.head' must be a JSON object, got int"),
    "no key": (_drop(["constants", "head", "key"]), "SchemaError: field 'constants.head.key' is missing"),
    "key type": (_set(["constants", "head", "key"], 5),
                 "SchemaError: field 'constants.head.key' must be a string, got 5"),
    "no shape": (_drop(["constants", "head", "shape"]), "SchemaError: field 'constants.head.shape' is missing"),
    "shape type": (_set(["constants", "head", "shape"], "10x6"),
                   "SchemaError: field 'constants.head.shape' must be a list, got '10x6'"),
    "negative size": (_set(["constants", "head", "shape"], [-1, 6]),
                      "SchemaError: field 'constants.head.shape[0]' must be an integer >= 0, got -1"),
    "no stride": (_drop(["constants", "head", "stride"]), "SchemaError: field 'constants.head.stride' is missing"),
    "stride type": (_set(["constants", "head", "stride"], "6,1"),
                    "SchemaError: field 'constants.head.stride' must be a list, got '6,1'"),
    "negative stride": (_set(["constants", "head", "stride"], [6, -1]),
                        "SchemaError: field 'constants.head.stride[1]' must be an integer >= 0, got -1"),
    "no dtype": (_drop(["constants", "head", "dtype"]), "SchemaError: field 'constants.head.dtype' is missing"),
    "dtype type": (_set(["constants", "head", "dtype"], 5),
                   "SchemaError: field 'constants.head.dtype' must be a string, got 5"),
    "stride rank": (_set(["constants", "head", "stride"], [6]),
                    "constant head: strides [6] do not lay out a dense tensor of shape [10, 6]"),
    "stride holes": (_set(["constants", "head", "stride"], [7, 1]),
                     "constant head: strides [7, 1] do not lay out a dense tensor of shape [10, 6]"),
    "nodes type": (_set(["nodes"], {}), "SchemaError: field 'nodes' must be a list, got {}"),
    "node type": (lambda d: d["nodes"].__setitem__(0, 5), "SchemaError: field 'nodes[0]' must be a JSON object, got 5"),
    "node op": (_node("input_ids", "op", "call_module"), "nodes[0] must be a placeholder, get_attr, call_function or "
                "output node with exactly its fields, got op 'call_module' with fields ['name', 'op']"),
    "node fields": (_node("input_ids", "target", "x"), "nodes[0] must be a placeholder, get_attr, call_function or "
                    "output node with exactly its fields, got op 'placeholder' with fields ['name', 'op', 'target']"),
    "after output": (lambda d: d["nodes"].append({"name": "late", "op": "placeholder"}),
                     "nodes[9] follows the output node"),
    "node name": (_node("input_ids", "name", "in-put"), f"nodes[0] name 'in-put' {_IDENTIFIER_RULE}"),
    "node name twice": (_node("head", "name", "table"), "node name table is used twice"),
    "get_attr name": (_node("head", "target", "1x"), f"node head: constant '1x' {_IDENTIFIER_RULE}"),
    "get_attr undeclared": (_node("head", "target", "nope"),
                            "node head reads constant nope, which the graph does not declare"),
    "args encoding": (_node("mul_tensor", "args", [{"node": "embedding_default"}, 2.0]),
                      "node mul_tensor: args must be a tuple encoding and kwargs a dict encoding"),
    "kwargs encoding": (_node("mul_tensor", "kwargs", []),
                        "node mul_tensor: args must be a tuple encoding and kwargs a dict encoding"),
    "keyword name": (_node("mul_tensor", "kwargs", {"dict": {"class": 1}}),
                     f"node mul_tensor: keyword argument 'class' {_IDENTIFIER_RULE}"),
    "kwargs refer forward": (_node("mul_tensor", "kwargs", {"dict": {"other": {"node": "getitem"}}}),
                             "argument refers to node 'getitem', which is not defined before it"),
    "args refer forward": (_node("mul_tensor", "args", {"tuple": [{"node": "getitem"}, 2.0]}),
                           "argument refers to node 'getitem', which is not defined before it"),
    "output kwargs": (_node("output", "kwargs", {"dict": {"a": 1}}), _OUTPUT_RULE),
    "output args list": (_node("output", "args", [[{"node": "linear_cpu"}]]), _OUTPUT_RULE),
    "output two args": (_node("output", "args", {"tuple": [{"tuple": [{"node": "linear_cpu"}]}, 1]}), _OUTPUT_RULE),
    "output no sequence": (_node("output", "args", {"tuple": [{"node": "linear_cpu"}]}), _OUTPUT_RULE),
    "output count": (_node("output", "args", {"tuple": [{"tuple": [{"node": "linear_cpu"}, {"node": "mul_tensor"}]}]}),
                     _OUTPUT_RULE),
    "output not a node": (_node("output", "args", {"tuple": [{"tuple": [1]}]}), _OUTPUT_RULE),
    "output not a tensor": (_node("output", "args", {"tuple": [{"tuple": [{"node": "split_tensor"}]}]}),
                            _OUTPUT_RULE),
    "output refers forward": (_node("output", "args", {"tuple": [{"tuple": [{"node": "nowhere"}]}]}),
                              "argument refers to node 'nowhere', which is not defined before it"),
    "no output node": (lambda d: d["nodes"].pop(), "a graph has 1 placeholders (one per input) and ends with its "
                       "output node; this one has 1 placeholders"),
    "no nodes": (_set(["nodes"], []), "a graph has 1 placeholders (one per input) and ends with its output node; "
                 "this one has 0 placeholders"),
    "two placeholders": (lambda d: d["nodes"].insert(1, {"name": "extra_in", "op": "placeholder"}),
                         "a graph has 1 placeholders (one per input) and ends with its output node; this one has 2 "
                         "placeholders"),
}


@pytest.mark.parametrize("case", list(_REFUSALS))
def test_a_malformed_graph_is_refused_naming_the_problem(case):
    mutate, message = _REFUSALS[case]
    data = copy.deepcopy(ENCODED)
    mutate(data)
    program, weights = _program()
    with pytest.raises(GraphFormatError) as raised:
        parse_program(data, weights.__getitem__)
    assert str(raised.value) == message


def test_refusal_messages_are_capped_in_length():
    _, weights = _program()
    for mutate, cap, start in [
        (_set(["format"], "x" * 300), 200, "graph format 'xxx"),
        (_node("input_ids", "y" * 400, 1), 300, "nodes[0] must be a placeholder"),
        (_set(["constants", "head", "dtype"], "float99"), 300, "SchemaError: field 'constants.head.dtype' must be one"),
    ]:
        data = copy.deepcopy(ENCODED)
        mutate(data)
        with pytest.raises(GraphFormatError) as raised:
            parse_program(data, weights.__getitem__)
        assert str(raised.value).startswith(start) and len(str(raised.value)) == cap
    with pytest.raises(GraphFormatError, match="^graph format 'list'; this ttftc reads format 1$"):
        parse_program([], weights.__getitem__)


def test_each_empty_or_size_one_dimension_is_a_dense_layout():
    _, weights = _program()
    data = copy.deepcopy(ENCODED)
    data["constants"]["head"].update(shape=[0, 6], stride=[6, 1])
    empty = torch.empty(0, 6)
    spec = parse_program(data, {"table": weights["table"], "head": empty}.__getitem__)
    assert spec.constants["head"].tensor is empty
    data["constants"]["head"].update(shape=[1, 6], stride=[0, 1])  # a size-1 dimension may have any stride
    row = torch.randn(1, 6)
    spec = parse_program(data, {"table": weights["table"], "head": row}.__getitem__)
    assert spec.constants["head"].stride == (0, 1)


@pytest.mark.parametrize("error", [KeyError, FileNotFoundError])
def test_a_missing_constant_is_refused(error):
    def load(key):
        raise error(key)

    with pytest.raises(GraphFormatError) as raised:
        parse_program(copy.deepcopy(ENCODED), load)
    assert str(raised.value) == "constant table: its tensor 'table' is missing"


@pytest.mark.parametrize("stored, message", [
    (torch.randn(3, 3), "constant head: stored tensor is (3, 3) torch.float32, the graph wants (10, 6) float32"),
    (torch.randn(10, 6, dtype=torch.float64),
     "constant head: stored tensor is (10, 6) torch.float64, the graph wants (10, 6) float32"),
    ([[0.0] * 6] * 10, "constant head: stored tensor is () list, the graph wants (10, 6) float32"),
])
def test_a_stored_constant_must_be_the_declared_tensor(stored, message):
    _, weights = _program()
    with pytest.raises(GraphFormatError) as raised:
        parse_program(copy.deepcopy(ENCODED), {"table": weights["table"], "head": stored}.__getitem__)
    assert str(raised.value) == message


@pytest.mark.parametrize("value, encoded", [
    (None, None), (True, True), ("text", "text"), (3, 3), (2.5, 2.5),
    (math.inf, {"float": "inf"}), (-math.inf, {"float": "-inf"}),
    ((1, (2,)), {"tuple": [1, {"tuple": [2]}]}), ([1, [2]], [1, [2]]), (torch.Size([2, 3]), {"tuple": [2, 3]}),
    ({"a": (1,), "b": None}, {"dict": {"a": {"tuple": [1]}, "b": None}}),
    (torch.bfloat16, {"dtype": "bfloat16"}), (torch.device("cpu"), {"device": "cpu"}),
    (torch.strided, {"layout": "strided"}), (torch.channels_last, {"memory_format": "channels_last"}),
])
def test_argument_encodings_round_trip(value, encoded):
    assert gf._encode_arg(value) == encoded
    decoded = gf._decode_arg(encoded, {})
    assert decoded == value
    assert type(decoded) is (tuple if isinstance(value, torch.Size) else type(value))  # a Size is a tuple


def test_nan_and_node_arguments_round_trip():
    assert gf._encode_arg(math.nan) == {"float": "nan"} and math.isnan(gf._decode_arg({"float": "nan"}, {}))
    graph = fx.Graph()
    x = graph.placeholder("x")
    assert gf._encode_arg(x) == {"node": "x"}
    ref = gf._decode_arg({"node": "x"}, {"x": TENSOR})
    assert isinstance(ref, Ref) and ref.name == "x"
    assert [r.name for r in gf._decode_arg([{"node": "x"}, {"tuple": [{"node": "x"}]}], {"x": TENSOR})[1]] == ["x"]
    assert gf._decode_arg({"dict": {"k": {"node": "x"}}}, {"x": TENSOR})["k"].name == "x"


def test_an_argument_of_another_type_cannot_be_saved():
    with pytest.raises(GraphFormatError) as raised:
        gf._encode_arg(slice(1))
    assert str(raised.value) == "argument slice(None, 1, None) of type slice cannot be saved"


@pytest.mark.parametrize("encoded, message", [
    ({}, "argument {} is not a JSON scalar, a list or a one-key encoding"),
    ({"tuple": [], "dict": {}}, "argument {'tuple': [], 'dict': {}} is not a JSON scalar, a list or a one-key encoding"),
    ((1,), "argument (1,) is not a JSON scalar, a list or a one-key encoding"),
    ({"node": "x"}, "argument refers to node 'x', which is not defined before it"),
    ({"node": 5}, "argument refers to node 5, which is not defined before it"),
    ({"tuple": "ab"}, "unknown argument encoding {'tuple': 'ab'}"),
    ({"tuple": {"a": 1}}, "unknown argument encoding {'tuple': {'a': 1}}"),
    ({"dict": [1]}, "unknown argument encoding {'dict': [1]}"),
    ({"float": "1.5"}, "unknown argument encoding {'float': '1.5'}"),
    ({"float": [1.5]}, "unknown argument encoding {'float': [1.5]}"),
    ({"dtype": "inf"}, "unknown argument encoding {'dtype': 'inf'}"),
    ({"dtype": "Tensor"}, "unknown argument encoding {'dtype': 'Tensor'}"),
    ({"layout": "float32"}, "unknown argument encoding {'layout': 'float32'}"),
    ({"dtype": 5}, "unknown argument encoding {'dtype': 5}"),
    ({"what": "x"}, "unknown argument encoding {'what': 'x'}"),
    ({"device": "nonsense"}, "unknown device 'nonsense'"),
    ({"dict": {1: 2}}, "dict argument key 1 is not a short string"),
    ({"dict": {"k" * 257: 1}}, None),
])
def test_undecodable_arguments_are_refused(encoded, message):
    with pytest.raises(GraphFormatError) as raised:
        gf._decode_arg(encoded, {"y": TENSOR})
    if message is None:  # too long to show whole: cut at 200 characters
        assert str(raised.value).startswith("dict argument key 'kkk") and len(str(raised.value)) == 200
    else:
        assert str(raised.value) == message


@pytest.mark.parametrize("encoded, start", [
    ({"x" * 300: 1, "y": 2}, "argument {'xxx"),
    ({"node": "x" * 300}, "argument refers to node 'xxx"),
    ({"what": "x" * 300}, "unknown argument encoding {'what': 'xxx"),
    ({"device": "x" * 300}, "unknown device 'xxx"),
])
def test_decoding_messages_are_capped_at_200_characters(encoded, start):
    with pytest.raises(GraphFormatError) as raised:
        gf._decode_arg(encoded, {})
    assert str(raised.value).startswith(start) and len(str(raised.value)) == 200


def test_dict_keys_up_to_256_characters_are_kept():
    assert gf._decode_arg({"dict": {"k" * 256: 1}}, {}) == {"k" * 256: 1}


@pytest.mark.parametrize("wrap", [
    lambda inner: [inner],
    lambda inner: {"tuple": [inner]},
    lambda inner: {"dict": {"k": inner}},
])
def test_arguments_nest_at_most_16_levels(wrap):
    value = 1
    for _ in range(16):
        value = wrap(value)
    assert gf._decode_arg(value, {}) is not None  # 16 levels: fine
    with pytest.raises(GraphFormatError) as raised:
        gf._decode_arg(wrap(value), {})
    assert str(raised.value) == "arguments nest deeper than 16 levels"


@pytest.mark.parametrize("name, ok", [
    ("abc_1", True), ("_x", True), ("x__", True), ("Self", True),
    (1, False), ("1a", False), ("a-b", False), ("é", False), ("class", False), ("__x", False), ("self", False),
    ("torch", False), ("", False),
])
def test_identifiers(name, ok):
    if ok:
        assert gf._identifier(name, "node name") == name
    else:
        with pytest.raises(GraphFormatError) as raised:
            gf._identifier(name, "node name")
        assert str(raised.value) == f"node name {name!r} {_IDENTIFIER_RULE}"


@pytest.mark.parametrize("shape, stride, dense", [
    ([2, 3], [3, 1], True), ([2, 3], [1, 2], True), ([3, 2], [1, 3], True), ([2, 3, 4], [12, 4, 1], True),
    ([2, 3, 4], [1, 8, 2], True), ([1, 3], [100, 1], True), ([2, 1], [1, 0], True), ([], [], True),
    ([0, 3], [3, 1], True),
    ([2, 3], [3, 2], False), ([2, 3], [4, 1], False), ([2, 3], [1, 1], False), ([2, 3], [99, 1], False),
    ([2, 3, 4], [12, 3, 1], False), ([3], [2], False),
])
def test_dense_layouts(shape, stride, dense):
    assert gf._dense(shape, stride) is dense


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float64), ("meta", torch.bfloat16)])
def test_build_lays_constants_out_with_their_stored_strides(device, dtype):
    _, weights = _program()
    data = copy.deepcopy(ENCODED)
    data["constants"]["head"].update(stride=[1, 10], dtype=str(dtype).removeprefix("torch."))
    head = torch.randn(10, 6, dtype=dtype, device=device) if device == "cpu" else torch.empty(10, 6, dtype=dtype,
                                                                                                  device=device)
    table = weights["table"].to(device)  # every constant on the graph's device type
    built = parse_program(data, {"table": table, "head": head}.__getitem__, device).build()
    stored = built.gm.head
    assert stored.stride() == (1, 10) and stored.dtype == dtype and stored.device == torch.device(device)
    if device == "cpu":
        assert torch.equal(stored, head)
    assert built.gm.table is table  # already laid out as stored: used as is


def test_build_binds_nodes_inside_lists_and_keyword_arguments():
    root = torch.nn.Module()
    root.register_buffer("table", torch.randn(VOCAB, WIDTH))
    graph = fx.Graph()
    ids = graph.placeholder("input_ids")
    x = graph.call_function(torch.ops.aten.embedding.default, (graph.get_attr("table"), ids))
    both = graph.call_function(torch.ops.aten.cat.default, ([x, x], 2))
    y = graph.call_function(torch.ops.aten.mul.Tensor, (both,), {"other": both})
    graph.output((y,))
    program = GraphProgram(SIGNATURE, fx.GraphModule(root, graph), ["input_ids"], ["logits"])
    data = encode_program(program, lambda t: "table")
    loaded = decode_program(data, {"table": root.table}.__getitem__)
    ids = torch.tensor([[1, 2, 3, 9]])
    assert torch.equal(loaded({"input_ids": ids})["logits"], program({"input_ids": ids})["logits"])


def test_the_encoder_refuses_modules_overlapping_constants_and_non_tensor_constants():
    program, weights = _program()
    program.gm.add_submodule("sub", torch.nn.Identity())
    with program.gm.graph.inserting_before(next(n for n in program.gm.graph.nodes if n.op == "output")):
        program.gm.graph.call_module("sub", (next(iter(program.gm.graph.nodes)),))
    with pytest.raises(GraphFormatError, match=r"^call_module node sub cannot be saved \(graphs are flat aten graphs\)$"):
        encode_program(program, _keyed(weights))
    program, weights = _program()
    program.gm.head = weights["head"] = torch.randn(1, WIDTH).expand(VOCAB, WIDTH)
    with pytest.raises(GraphFormatError, match=r"^constant head has overlapping strides \(0, 1\); cannot be saved$"):
        encode_program(program, _keyed(weights))
    program, weights = _program()
    del program.gm.table
    program.gm.table = 3.0
    with pytest.raises(GraphFormatError, match="^constant table is a float; only tensors can be saved$"):
        encode_program(program, _keyed(weights))


def test_graph_constants_follow_dotted_paths_after_the_first_placeholder():
    program, weights = _program()
    program.gm.add_submodule("sub", torch.nn.Module())
    program.gm.sub.register_buffer("w", weights["head"])
    next(n for n in program.gm.graph.nodes if n.op == "get_attr" and n.target == "head").target = "sub.w"
    constants = gf.graph_constants(program.gm)
    assert list(constants) == ["table", "sub.w"] and constants["sub.w"] is weights["head"]


def test_the_encoder_reports_what_the_decoder_refuses():
    program, weights = _program(kwargs={"no_such_knob": 1})
    with pytest.raises(GraphFormatError) as raised:
        encode_program(program, _keyed(weights))
    assert str(raised.value).startswith("the graph cannot be saved: node linear_cpu: ")


def test_the_tagged_value_tables_are_torchs_own_names():
    dtypes = gf._tagged(torch.dtype)
    assert dtypes == gf._DTYPES and dtypes["bfloat16"] is torch.bfloat16 and dtypes["float"] is torch.float32
    assert gf._tagged(torch.layout)["strided"] is torch.strided
    assert gf._tagged(torch.memory_format)["channels_last"] is torch.channels_last


def test_the_input_and_output_names_are_fields_of_the_document_itself():
    # parse_program checks the field set first; called alone, _parse_names names a missing field at the top level
    with pytest.raises(SchemaError, match=r"^field 'inputs' is missing$"):
        gf._parse_names({"outputs": ["logits"]})
    with pytest.raises(SchemaError, match=r"^field 'outputs' is missing$"):
        gf._parse_names({"inputs": ["input_ids"]})
    assert gf._parse_names({"inputs": ["input_ids"], "outputs": ["logits"]}) == (("input_ids",), ("logits",))
