"""Issue items 1-3: a stored graph cannot make the loading process run code.

Each test edits one graph of a clean artifact the way the review's attacker did, recomputes the manifest's checksums,
and loads it. The load itself must refuse (an ArtifactError, not an error at the first call), and the marker the
payload would create must not exist.
"""

import json

import pytest

import ttftc
from tests.security.attack import first_node, forge
from tests.security.conftest import PROMPT
from ttftc.aot import ArtifactError

GRAPH = "graphs/b16_n1_last_kv.json"
# A unary aten op every artifact graph keeps after the passes (the RoPE table's cos): the node the attacks rewrite.
ANCHOR = {"op": "aten::cos.default"}


def _call(target: dict, *args) -> callable:
    """A mutation that makes the first aten::cos node call `target` with `args`."""

    def mutate(graph):
        node = first_node(graph, ANCHOR)
        node["target"] = target
        node["args"] = {"tuple": list(args)}

    return mutate


def _refused(artifact, outside, match: str) -> None:
    with pytest.raises(ArtifactError, match=match):
        ttftc.load(artifact)  # refused while loading: no model object, so no first call either
    outside.assert_untouched()


# -- item 1: `fn` targets reach only operator.getitem and registered lowerings --------------------------------
@pytest.mark.parametrize("function", [
    "torch:os.system",                          # attribute walk from an allowed module prefix
    "torch.os:system",
    "os:system",
    "builtins:exec",
    "torch:load",
    "torch:save",
    "torch.hub:load",
    "torch.utils.cpp_extension:load_inline",
    "torchao.quantization:quantize_",           # the old prefix check admitted torchao and torchgen
    "torchgen.model:FunctionSchema",
    "operator:methodcaller",
    "_operator:attrgetter",
    "ttftc.codegen.cpu.norm:os.system",         # a lowering module, walked into
    "ttftc.codegen.cpu.norm:torch.load",
    "ttftc.codegen.cpu.norm:normalize_cpu",     # a function of a lowering module that is not a registered lowering
    "ttftc.codegen.cpu._threads:intra_op_threads",
    "ttftc.codegen.cpu.attention:attention_cpu.__globals__",
    "ttftc.cache.store:os.unlink",
    "ttftc.codegen.cpu.../../etc:x",
])
def test_fn_targets_off_the_allow_list_are_refused(artifact, outside, function):
    forge(artifact, GRAPH, _call({"fn": function}, outside.shell_payload))
    _refused(artifact, outside, "not operator.getitem or a ttftc lowering|not a registered ttftc lowering")


# -- item 2: `op` targets are aten/ttftc OpOverloads, found without walking attributes ------------------------
@pytest.mark.parametrize("op", [
    "load_library::__self__.load_library",      # the review's path to torch.ops.load_library
    "_ops::load_library.default",
    "aten::__self__.load_library",
    "aten::neg.__call__",
    "aten::neg",
    "prims::neg.default",
    "quantized::add.default",
    "ttftc_impl::linear_cpu.default",
])
def test_op_targets_outside_aten_and_ttftc_are_refused(artifact, outside, op):
    forge(artifact, GRAPH, _call({"op": op}, outside.shell_payload))
    _refused(artifact, outside, "is not an aten or ttftc op name")


@pytest.mark.parametrize("op", ["aten::from_file.default", "aten::_print.default", "aten::_unsafe_index.Tensor",
                                "aten::_sparse_coo_tensor_unsafe.default", "aten::set_.source_Storage"])
def test_aten_ops_that_read_files_print_or_skip_bounds_checks_are_refused(artifact, outside, op):
    forge(artifact, GRAPH, _call({"op": op}, str(outside.victims[0]), True, 4))
    _refused(artifact, outside, "reads files, prints, or skips bounds checks")


def test_an_aten_op_that_returns_no_tensor_is_refused(artifact, outside):
    forge(artifact, GRAPH, _call({"op": "aten::_local_scalar_dense.default"}, {"node": "arg0_1"}))
    _refused(artifact, outside, "not tensors")


# -- item 3: names that FX pastes into generated Python -------------------------------------------------------
def test_keyword_name_injection_on_an_allowed_op(artifact, outside):
    """The review's compile-cache exploit, on an artifact: the target stays aten::cos, one kwarg name carries code."""

    def mutate(graph):
        node = first_node(graph, ANCHOR)
        node["kwargs"] = {"dict": {f"x={outside.python_payload},y": 1}}

    forge(artifact, GRAPH, mutate)
    _refused(artifact, outside, "not a plain Python identifier")


def test_a_keyword_the_schema_does_not_declare_is_refused(artifact, outside):
    forge(artifact, GRAPH, lambda g: first_node(g, ANCHOR).update(kwargs={"dict": {"alpha": 2}}))
    _refused(artifact, outside, "'alpha' is not an argument of aten::cos.default")


def test_node_name_injection(artifact, outside):
    def mutate(graph):
        placeholder = next(n for n in graph["nodes"] if n["op"] == "placeholder")
        old, new = placeholder["name"], f"x={outside.python_payload}"
        text = json.dumps(graph).replace(f'"{old}"', json.dumps(new))
        return json.loads(text)  # every reference renamed too, so only the name itself is wrong

    forge(artifact, GRAPH, mutate, replace=True)
    _refused(artifact, outside, "is not a plain Python identifier")


@pytest.mark.parametrize("name", ["torch", "self", "__class__", "None", "class", "a.b", "a b", ""])
def test_names_fx_would_mishandle_are_refused(artifact, outside, name):
    def mutate(graph):
        node = first_node(graph, ANCHOR)
        node["name"] = name

    forge(artifact, GRAPH, mutate)
    _refused(artifact, outside, "is not a plain Python identifier")


def test_get_attr_target_injection(artifact, outside):
    def mutate(graph):
        node = next(n for n in graph["nodes"] if n["op"] == "get_attr")
        node["target"] = f'x")+{outside.python_payload}+getattr(self,"y'

    forge(artifact, GRAPH, mutate)
    _refused(artifact, outside, "constant .* is not a plain Python identifier")


@pytest.mark.parametrize("name", ['x")+__import__("os").system("true")+("', "training", "forward", "_modules"])
def test_constant_name_injection(artifact, outside, name):
    def mutate(graph):
        old = next(iter(graph["constants"]))
        graph["constants"][name] = graph["constants"].pop(old)
        for node in graph["nodes"]:
            if node["op"] == "get_attr" and node["target"] == old:
                node["target"] = name

    forge(artifact, GRAPH, mutate)
    _refused(artifact, outside, "not a plain Python identifier|attribute every torch.nn.Module has")


@pytest.mark.parametrize("value", [
    {"dtype": "load"},                    # torch.load where a dtype belongs
    {"device": "../../x"},
    {"float": "__import__('os')"},
    {"node": "nowhere"},
    {"evil": 1},
])
def test_tagged_argument_values_outside_their_tables_are_refused(artifact, outside, value):
    forge(artifact, GRAPH, lambda g: first_node(g, {"op": "aten::_to_copy.default"}).update(
        kwargs={"dict": {"dtype": value}}))
    _refused(artifact, outside, "cannot be read")


def test_a_mistyped_argument_is_refused_at_load_not_at_the_first_call(artifact, outside):
    forge(artifact, GRAPH, lambda g: first_node(g, {"op": "aten::unsqueeze.default"})["args"]["tuple"].__setitem__(
        1, "2"))
    _refused(artifact, outside, "argument 'dim' of aten::unsqueeze.default must be int")


def test_the_clean_artifact_still_loads_and_matches(clean_artifact, clean_logits):
    """The checks above refuse the attacks, not the artifact: the untouched copy serves the same logits."""
    out = ttftc.load(clean_artifact)(PROMPT, logits_to_keep=1).logits
    assert out.equal(clean_logits)
