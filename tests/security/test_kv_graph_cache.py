"""Crafted compile-cache entries for the KV path's graphs (dynamic shapes, cache/dynamic_format.py): each new field
of the format (placeholder positions, size arithmetic, tuned lowerings, outputs that are sizes, stored guards, the
dims marked dynamic) is refused when it is anything ttftc would not write, before any graph is built or run; at the
file level, a crafted entry is a miss with one warning and is deleted, never followed through a link, never read
past its size limit."""

import copy
import json
import os
import warnings

import pytest
import torch

import ttftc
from tests.helpers import needs_transformers
from ttftc import zoo
from ttftc.cache import CompileCache
from ttftc.capture import MAX_GUARDS
from ttftc.cache.dynamic_format import parse_dynamic
from ttftc.cache.dynamic_graphs import MAX_ENTRY_BYTES, MAX_VARIANTS, DynamicGraphCache
from ttftc.cache.graph_calls import GraphFormatError, _SYM_FUNCTIONS, resolve_target
from ttftc.dynamo_backend import TtftcBackend
from ttftc.runtime.kv import new_cache, reserve

pytestmark = needs_transformers


class Recording(DynamicGraphCache):
    """Keeps, for each graph saved, the description of Dynamo's graph it was saved for."""

    def __init__(self, *args):
        super().__init__(*args)
        self.saved = []

    def save(self, config, description, graph):
        super().save(config, description, graph)
        self.saved.append((config, description))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """The KV graphs of a tiny llama compiled once into a cache: (cache, [(description, stored variant)])."""
    root = tmp_path_factory.mktemp("kv") / "cache"
    model = zoo.build("llama", "sdpa")
    cache = Recording(CompileCache(root), model)
    compiled = torch.compile(model, backend=TtftcBackend(ttftc.Config(precision="fp32"), graph_cache=cache),
                             dynamic=True)
    for chunks in (((13, 0), (11, 13), (1, 24)), ((1, 0), (1, 1))):
        kv = new_cache(model)
        for n, start in chunks:
            reserve(kv, start + n)
            with torch.no_grad():
                compiled(input_ids=torch.arange(3, 3 + n).unsqueeze(0),
                         position_ids=torch.arange(start, start + n).unsqueeze(0), past_key_values=kv, use_cache=True,
                         logits_to_keep=1)
    graphs = []
    for config, description in cache.saved:
        entry = json.loads((root / "entries" / f"{cache.key(config, description)}.json").read_text())
        graphs += [(description, variant) for variant in entry["dynamic"]]
    assert len(graphs) >= 3
    torch._dynamo.reset()
    return cache, graphs


def parse(cache, description, variant, vocab_size=None):
    blobs = lambda key: cache.cache._load_blob(key, torch.device("cpu"))  # noqa: E731
    return parse_dynamic(variant, blobs, "cpu", description, vocab_size, description.outputs)


def with_node(graphs, test):
    """(description, a copy of the first stored variant with a node passing `test`, that node's index)."""
    for description, variant in graphs:
        for i, node in enumerate(variant["nodes"]):
            if test(node):
                return description, copy.deepcopy(variant), i
    pytest.skip("no stored graph has such a node")


def test_every_stored_variant_parses_as_written(stored):
    cache, graphs = stored
    for description, variant in graphs:
        spec = parse(cache, description, variant, cache.vocab_size)
        assert len(spec.inputs) == sum(1 for n in variant["nodes"] if n["op"] == "placeholder")


def is_call(name):
    return lambda node: node["op"] == "call_function" and node["target"] == name


SYM_ADD = is_call({"fn": "_operator:add"})
EMBEDDING = is_call({"op": "aten::embedding.default"})


def _deep(term, depth):
    for _ in range(depth):
        term = {"add": [term, 1]}
    return term


GUARDS = {
    "not a list": lambda g, sym: {"eq": [1, 1]},
    "too many": lambda g, sym: [{"eq": [1, 1]}] * (MAX_GUARDS + 1),
    "not a comparison": lambda g, sym: [{"pow": [sym, 2]}],
    "three operands": lambda g, sym: [{"eq": [sym, 1, 2]}],
    "a symbol the graph does not have": lambda g, sym: [{"eq": [{"symbol": ["input", 999]}, 1]}],
    "a symbol that is a weight's size": lambda g, sym: [{"eq": [{"symbol": ["size", 2, 0]}, 1]}],
    "an integer past 2**62": lambda g, sym: [{"eq": [sym, 1 << 63]}],
    "a bool": lambda g, sym: [{"eq": [sym, True]}],
    "a float": lambda g, sym: [{"eq": [sym, 1.5]}],
    "nested too deep": lambda g, sym: [{"eq": [_deep(sym, 40), 1]}],
    "a sum of one term": lambda g, sym: [{"eq": [{"add": [sym]}, 1]}],
    "an unknown function": lambda g, sym: [{"eq": [{"pow": [sym, sym]}, 1]}],
}


@pytest.mark.parametrize("case", sorted(GUARDS))
def test_a_crafted_guard_is_refused(stored, case):
    cache, graphs = stored
    description, variant = graphs[0][0], copy.deepcopy(graphs[0][1])
    symbol = {"symbol": list(next(iter(description.symbols.values())))}
    variant["guards"] = GUARDS[case](variant["guards"], symbol)
    with pytest.raises(GraphFormatError):
        parse(cache, description, variant)


NODES = {
    # size arithmetic: only the allow-listed ops, on ints and sizes
    "pow on sizes": lambda node, tensor: node.update(target={"fn": "_operator:pow"}),
    "lshift on sizes": lambda node, tensor: node.update(target={"fn": "_operator:lshift"}),
    "a size op on a tensor": lambda node, tensor: node.update(args={"tuple": [{"node": tensor}, 1]}),
    "a size op on an int past int64": lambda node, tensor: node["args"]["tuple"].__setitem__(1, 1 << 64),
    "a size op on a bool": lambda node, tensor: node["args"]["tuple"].__setitem__(1, True),
    "a size op with keywords": lambda node, tensor: node.update(kwargs={"dict": {"other": 1}}),
    "a size op with one argument": lambda node, tensor: node.update(args={"tuple": [1]}),
    # targets only resolve through tables
    "a tuned target that is not a lowering": lambda node, tensor: node.update(target={"tuned": "os:system"}),
    "a tuned target naming a module attribute": lambda node, tensor: node.update(
        target={"tuned": "ttftc.codegen.cpu.linear:os"}),
    "a prims op other than convert_element_type": lambda node, tensor: node.update(
        target={"op": "prims::as_strided.default"}),
    "a function by module path": lambda node, tensor: node.update(target={"fn": "builtins:eval"}),
    "a torch size function off the list": lambda node, tensor: node.update(target={"fn": "torch:sym_sqrt"}),
}


@pytest.mark.parametrize("case", sorted(NODES))
def test_a_crafted_size_op_or_target_is_refused(stored, case):
    cache, graphs = stored
    description, variant, index = with_node(graphs, SYM_ADD)
    tensor = next(n["name"] for n in variant["nodes"] if n["op"] == "get_attr")
    NODES[case](variant["nodes"][index], tensor)
    with pytest.raises(GraphFormatError):
        parse(cache, description, variant)


def test_a_size_where_a_tensor_belongs_is_refused(stored):
    cache, graphs = stored
    description, variant, index = with_node(graphs, EMBEDDING)
    symbolic = [i for i, position in enumerate(variant["inputs"]) if description.input_kinds[position] == "symint"]
    size = [n for n in variant["nodes"] if n["op"] == "placeholder"][symbolic[0]]["name"]
    variant["nodes"][index]["args"]["tuple"][0] = {"node": size}  # the embedding's table becomes a size
    with pytest.raises(GraphFormatError, match="weight"):
        parse(cache, description, variant)


def test_an_embedding_with_fewer_rows_than_token_ids_is_refused(stored):
    cache, graphs = stored
    description, variant, _ = with_node(graphs, EMBEDDING)
    with pytest.raises(GraphFormatError, match="rows"):
        parse(cache, description, variant, vocab_size=cache.vocab_size + 1)


def _placeholders(variant):
    return [n for n in variant["nodes"] if n["op"] == "placeholder"]


STRUCTURE = {
    "inputs decreasing": lambda v, d: v.update(inputs=list(reversed(v["inputs"]))),
    "an input past the graph's": lambda v, d: v["inputs"].__setitem__(-1, len(d.input_kinds)),
    "a negative input": lambda v, d: v["inputs"].__setitem__(0, -1),
    "an input that is a bool": lambda v, d: v["inputs"].__setitem__(0, True),
    "more placeholders than inputs": lambda v, d: v["nodes"].insert(0, {"name": "extra", "op": "placeholder"}),
    "fewer placeholders than inputs": lambda v, d: v["nodes"].remove(_placeholders(v)[-1]),
    "a placeholder after a call": lambda v, d: v["nodes"].insert(len(v["nodes"]) - 1,
                                                                  {"name": "late", "op": "placeholder"}),
    "another output count": lambda v, d: v.update(outputs=v["outputs"] + 1),
    "an output that is a literal": lambda v, d: v["nodes"][-1]["args"]["tuple"].__setitem__(0, 3),
    "dynamic_dims of another length": lambda v, d: v.update(dynamic_dims=v["dynamic_dims"] + [None]),
    "a dynamic dim of 64": lambda v, d: v["dynamic_dims"].__setitem__(-1, [64]),
    "a repeated dynamic dim": lambda v, d: v["dynamic_dims"].__setitem__(-1, [0, 0]),
    "a dynamic dim that is a string": lambda v, d: v["dynamic_dims"].__setitem__(-1, ["0"]),
    "dynamic_dims missing": lambda v, d: v.pop("dynamic_dims"),
    "an extra field": lambda v, d: v.update(code="import os"),
    "the bucket graphs' format": lambda v, d: v.update(format=1),
    "a node name that is not an identifier": lambda v, d: _placeholders(v)[0].update(name="__import__('os')"),
}


@pytest.mark.parametrize("case", sorted(STRUCTURE))
def test_a_crafted_structure_is_refused(stored, case):
    cache, graphs = stored
    description, variant = graphs[0][0], copy.deepcopy(graphs[0][1])
    STRUCTURE[case](variant, description)
    with pytest.raises(GraphFormatError):
        parse(cache, description, variant)


def test_size_ops_and_tuned_targets_are_refused_in_a_bucket_graph():
    """The bucket graphs (graph_format.py) have concrete shapes: nothing symbolic resolves there."""
    for target in ({"fn": "_operator:add"}, {"op": "aten::sym_size.int"}, {"tuned": "ttftc.codegen.cpu.linear:x"}):
        with pytest.raises(GraphFormatError):
            resolve_target(target)


def test_size_arithmetic_that_leaves_int64_raises_at_run_time():
    """A chain of products in a crafted graph could grow a Python int without bound; each op checks its result."""
    mul = _SYM_FUNCTIONS["_operator:mul"].target
    assert mul(1 << 31, 1 << 31) == 1 << 62
    with pytest.raises(OverflowError):
        mul(1 << 62, 4)


# -- the entry file ---------------------------------------------------------------------------------------------------
def _entry(cache, config, description):
    return cache.cache.root / "entries" / f"{cache.key(config, description)}.json"


@pytest.fixture
def one_entry(stored, tmp_path):
    """A private cache holding one stored KV graph: (DynamicGraphCache, config, description, entry path)."""
    cache, graphs = stored
    private = DynamicGraphCache(CompileCache(tmp_path / "cache"), cache.model)
    config, description = cache.saved[0]
    variants = json.loads(_entry(cache, config, description).read_text())["dynamic"]
    for name in {c["key"] for v in variants for c in v["constants"].values()}:
        blob = cache.cache.root / "blobs" / f"{name}.safetensors"
        (tmp_path / "cache" / "blobs").mkdir(parents=True, exist_ok=True)
        (tmp_path / "cache" / "blobs" / blob.name).write_bytes(blob.read_bytes())
    path = _entry(private, config, description)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"dynamic": variants}))
    assert len(private.load(config, description)) == len(variants)
    return private, config, description, path


def _refused(cache, config, description, path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.load(config, description) == []
    assert any("ignoring corrupted entry" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_more_variants_than_an_entry_holds_is_a_miss_and_the_entry_goes(one_entry):
    cache, config, description, path = one_entry
    variant = json.loads(path.read_text())["dynamic"][0]
    path.write_text(json.dumps({"dynamic": [variant] * (MAX_VARIANTS + 1)}))
    _refused(cache, config, description, path)
    assert not path.exists()


def test_an_entry_over_its_size_limit_is_refused_unread(one_entry):
    cache, config, description, path = one_entry
    with open(path, "r+b") as f:
        f.truncate(MAX_ENTRY_BYTES + 1)  # sparse: costs no disk, and must cost no memory
    _refused(cache, config, description, path)


def test_a_symlinked_entry_is_unlinked_never_followed(one_entry, tmp_path):
    cache, config, description, path = one_entry
    target = tmp_path / "elsewhere.json"
    target.write_text(path.read_text())
    path.unlink()
    os.symlink(target, path)
    _refused(cache, config, description, path)
    assert not os.path.lexists(path) and target.exists()


def test_a_constant_the_entry_names_but_the_cache_lacks_is_a_miss(one_entry):
    loaded, config, description, path = one_entry
    for blob in (loaded.cache.root / "blobs").iterdir():
        blob.unlink()
    fresh = DynamicGraphCache(CompileCache(loaded.cache.root), loaded.model)  # no constant held in memory yet
    _refused(fresh, config, description, path)
