"""GraphSignature, the key of every compiled prefill graph: its name, its dict form, and the checks on a dict read
from a file; output_names, the names of a prefill graph's outputs."""

import pytest

from ttftc.buckets.program import GraphSignature, output_names

_FIELDS = "a graph signature has exactly the fields bucket, batch, logits, kv; got "


def test_a_signature_round_trips_through_its_dict_and_names_itself():
    signature = GraphSignature(32, batch=4, logits="last", kv=False)
    assert signature.to_dict() == {"bucket": 32, "batch": 4, "logits": "last", "kv": False}
    assert GraphSignature.from_dict(signature.to_dict()) == signature
    assert signature.name == "b32_n4_last_nokv" and GraphSignature(16).name == "b16_n1_all_kv"


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
    for count in (0, 2):
        with pytest.raises(ValueError, match=f"logits plus key/value pairs; got {count} outputs"):
            output_names(count)
