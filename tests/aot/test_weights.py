"""The safetensors reader: a valid file reads to the same tensors, held in process memory (a later write to the file
does not reach them); a hostile header is a ValueError."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from ttftc.aot.weights import read_file, tensors_in

CPU = torch.device("cpu")


def _write(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_maps_what_safetensors_wrote(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "empty": torch.zeros(0, 2)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    read = tensors_in(read_file(tmp_path / "w.safetensors"), CPU)
    assert set(read) == set(tensors) and all(torch.equal(read[k], tensors[k]) for k in tensors)


def test_tensors_do_not_see_later_writes_to_the_file(tmp_path):
    """A memory map would: a page the process has not written still reads the file, copy-on-write or not."""
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(4096)}, str(path))
    read = tensors_in(read_file(path), CPU)
    data = path.read_bytes()
    with open(path, "r+b") as f:  # the same inode, the same size
        f.write(data[:-4 * 4096] + torch.zeros(4096).numpy().tobytes())
    assert torch.equal(read["a"], torch.ones(4096))


def test_a_misaligned_tensor_is_copied_to_its_alignment(tmp_path):
    _write(tmp_path / "w.safetensors", {"b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                                        "a": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}},
           b"\x07" + torch.tensor([1.5, -2.0]).numpy().tobytes())
    read = tensors_in(read_file(tmp_path / "w.safetensors"), CPU)
    assert torch.equal(read["a"], torch.tensor([1.5, -2.0])) and read["b"].tolist() == [7]


def test_a_file_over_its_limit_is_refused_before_it_is_read(tmp_path):
    (tmp_path / "w").write_bytes(bytes(100))
    with pytest.raises(ValueError, match="100 bytes, more than the 99 expected"):
        read_file(tmp_path / "w", limit=99)
    assert read_file(tmp_path / "w", limit=100).numel() == 100


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
        tensors_in(read_file(tmp_path / "w.safetensors"), CPU)


def test_truncated_files_are_value_errors(tmp_path):
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(ValueError, match="shorter than a safetensors header"):
        tensors_in(read_file(tmp_path / "short"), CPU)
    (tmp_path / "long_header").write_bytes(struct.pack("<Q", 1 << 20) + b"{}")
    with pytest.raises(ValueError):
        tensors_in(read_file(tmp_path / "long_header"), CPU)
