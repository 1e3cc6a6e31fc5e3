"""GraphSignature, the key of every compiled prefill graph: its name, its dict form, and the checks on a dict read
from a file; output_names, the names of a prefill graph's outputs; ConstantPool, one copy of each constant across
the graphs of a model."""

import pytest
import torch
import torch.fx as fx

from ttftc.buckets.constants import ConstantPool, _fingerprint
from ttftc.buckets.program import GraphProgram, GraphSignature, output_names

_FIELDS = "a graph signature has exactly the fields bucket, batch, logits, kv; got "


def test_a_signature_round_trips_through_its_dict_and_names_itself():
    signature = GraphSignature(32, batch=4, logits="last", kv=False)
    assert signature.to_dict() == {"bucket": 32, "batch": 4, "logits": "last", "kv": False}
    assert GraphSignature.from_dict(signature.to_dict()) == signature
    assert signature.name == "b32_n4_last_nokv" and GraphSignature(16).name == "b16_n1_all_kv"
    assert GraphSignature(1).name == "b1_n1_all_kv"  # the smallest bucket and batch


def _signature(**fields):
    return {"bucket": 16, "batch": 1, "logits": "all", "kv": True, **fields}


@pytest.mark.parametrize("data, message", [
    ([16, 1, "all", True], _FIELDS + "[16, 1, 'all', True]"),
    ({"bucket": 16, "batch": 1, "logits": "all"}, _FIELDS + "{'bucket': 16, 'batch': 1, 'logits': 'all'}"),
    (_signature(bucket="16"), "graph signature field 'bucket' must be int, got '16'"),
    (_signature(bucket=True), "graph signature field 'bucket' must be int, got True"),
    (_signature(batch=1.0), "graph signature field 'batch' must be int, got 1.0"),
    (_signature(logits=0), "graph signature field 'logits' must be str, got 0"),
    (_signature(kv=1), "graph signature field 'kv' must be bool, got 1"),
    (_signature(logits="first"), "logits must be one of ('all', 'last'), got 'first'"),
    (_signature(bucket=0), "bucket and batch must be positive, got 0, 1"),
    (_signature(batch=0), "bucket and batch must be positive, got 16, 0"),
])
def test_a_dict_from_a_file_is_checked_field_by_field(data, message):
    with pytest.raises(ValueError) as raised:
        GraphSignature.from_dict(data)
    assert str(raised.value) == message


def test_outputs_are_the_logits_then_keys_and_values_per_layer():
    assert output_names(1) == ("logits",)
    assert output_names(5) == ("logits", "k0", "v0", "k1", "v1")
    for count in (-1, 0, 2, 4):
        with pytest.raises(ValueError, match=f"logits plus key/value pairs; got {count} outputs"):
            output_names(count)


def test_a_program_feeds_its_graph_the_named_inputs_in_order_and_names_its_outputs():
    graph = fx.Graph()
    ids, positions = graph.placeholder("ids"), graph.placeholder("positions")
    graph.output((graph.call_function(torch.sub, (ids, positions)), graph.call_function(torch.mul, (ids, positions)),
                  positions))
    signature = GraphSignature(8, batch=2)
    program = GraphProgram(signature, fx.GraphModule(torch.nn.Module(), graph), ["input_ids", "position_ids"],
                           iter(["logits", "k0", "v0"]))
    assert program.signature is signature and program.inputs == ("input_ids", "position_ids")
    assert program.outputs == ("logits", "k0", "v0")  # kept as a tuple, even from a one-pass iterator
    a, b = torch.tensor([5.0, 7.0]), torch.tensor([1.0, 2.0])
    out = program({"position_ids": b, "input_ids": a, "last_index": torch.tensor([0])})  # by name; extras unused
    assert list(out) == ["logits", "k0", "v0"]
    assert torch.equal(out["logits"], a - b) and torch.equal(out["k0"], a * b) and out["v0"] is b


def test_the_pool_keeps_one_tensor_per_layout_and_content():
    pool = ConstantPool()
    weight = torch.arange(12.0).reshape(3, 4)
    assert pool.intern(weight) is weight and pool.intern(weight) is weight
    assert pool.intern(weight.clone()) is weight  # equal content in another storage
    # the same values, each in another layout or dtype: a graph reads its constants by layout, so each is its own
    column_major = weight.t().contiguous().t()
    kept = [column_major, weight.to(torch.bfloat16), weight.reshape(12), weight.reshape(4, 3), weight + 1]
    for t in kept:
        assert pool.intern(t) is t
    assert pool.intern(weight.to(torch.bfloat16)) is kept[1]
    # 200 values are sampled every third one: a difference at index 1 is left to the full comparison
    long = torch.arange(200.0)
    changed = long.clone()
    changed[1] = -1.0
    assert _fingerprint(changed) == _fingerprint(long)
    assert pool.intern(long) is long and pool.intern(changed) is changed
    assert [id(t) for t in pool.tensors] == [id(t) for t in [weight, *kept, long, changed]]


def test_a_constant_holding_nan_is_pooled_once():
    # NaN != NaN, so only the identity check finds it again (e.g. the same buffer seen by two graphs)
    pool = ConstantPool()
    mask = torch.tensor([0.0, float("nan"), 1.0])
    assert pool.intern(mask) is mask and pool.intern(mask) is mask and len(pool.tensors) == 1
    assert pool.intern(mask.clone()) is not mask and len(pool.tensors) == 2


def test_a_fingerprint_samples_at_most_64_evenly_spaced_values():
    assert _fingerprint(torch.empty(0)) == ()
    assert _fingerprint(torch.tensor([7.0])) == (7.0,)
    assert _fingerprint(torch.arange(5.0).reshape(5, 1)) == (0.0, 1.0, 2.0, 3.0, 4.0)
    assert _fingerprint(torch.arange(1000.0)) == tuple(float(i) for i in range(0, 64 * 15, 15))
    assert _fingerprint(torch.tensor([1.5, -2.0], dtype=torch.bfloat16)) == (1.5, -2.0)


def test_interning_a_graph_replaces_its_own_buffers_by_the_pooled_copies():
    pool = ConstantPool()
    first, second = fx.GraphModule(torch.nn.Module(), fx.Graph()), fx.GraphModule(torch.nn.Module(), fx.Graph())
    first.register_buffer("w", torch.ones(4))
    second.register_buffer("w", torch.ones(4))
    second.register_buffer("b", torch.zeros(2))
    second.inner = torch.nn.Module()
    inner = torch.ones(4)
    second.inner.register_buffer("w", inner)
    pool.intern_graph(first)
    pool.intern_graph(second)
    assert second.w is first.w and second.b is pool.tensors[1] and len(pool.tensors) == 2
    assert set(second._buffers) == {"w", "b"} and second.inner.w is inner  # a submodule's buffers are its own
