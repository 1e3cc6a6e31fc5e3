"""The memory-mapped safetensors reader: a valid file maps to the same tensors; a hostile header is a ValueError."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from ttftc.aot.weights import map_safetensors

CPU = torch.device("cpu")


def _write(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_maps_what_safetensors_wrote(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "empty": torch.zeros(0, 2)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    mapped = map_safetensors(tmp_path / "w.safetensors", CPU)
    assert set(mapped) == set(tensors) and all(torch.equal(mapped[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("header, match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2],
                                                                        "data_offsets": [4, 12]}}, "share bytes"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "inside the file's 8 data bytes"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, "data_offsets"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "shape"),
    ({"a": {"dtype": "PYOBJ", "shape": [2], "data_offsets": [0, 8]}}, "dtype"),
    ({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, "shape"),
    ({"a": {"dtype": "F32", "shape": [2]}}, "data_offsets"),
    ({"a": ["F32"]}, "JSON object"),
    (["not", "a", "dict"], "JSON object"),
])
def test_hostile_headers_are_value_errors(tmp_path, header, match):
    _write(tmp_path / "w.safetensors", header, bytes(16 if "b" in header else 8))
    with pytest.raises(ValueError, match=match):
        map_safetensors(tmp_path / "w.safetensors", CPU)


def test_truncated_files_are_value_errors(tmp_path):
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(ValueError, match="shorter than a safetensors header"):
        map_safetensors(tmp_path / "short", CPU)
    (tmp_path / "long_header").write_bytes(struct.pack("<Q", 1 << 20) + b"{}")
    with pytest.raises(ValueError):
        map_safetensors(tmp_path / "long_header", CPU)
