"""Read a safetensors file as tensors over a private memory map: no copy at load time.

safetensors' own loader copies every tensor out of the file; mapping it instead makes loading cost nothing
up front (pages come from the page cache when a graph first reads them, and the checksum pass has just put
them there). The mapping is copy-on-write, so the tensors are writable without touching the file.

The header is untrusted (its checksum can be recomputed by whoever wrote it), so every entry is checked before a
tensor is made over the map: known dtype, a shape of non-negative ints, offsets inside the data section that hold
exactly that many bytes, and no two tensors sharing bytes. A bad header is a ValueError naming the tensor.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from ttftc.cache.schema import as_dict, as_int, as_list, as_str, field

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 << 20


def _entries(header: dict, data_bytes: int) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """name -> (dtype, shape, begin, end) for every tensor of a checked header; offsets are into the data section."""
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name!r}"
        dtype = _DTYPES[as_str(field(info, "dtype", where), f"{where}.dtype", choices=tuple(_DTYPES))]
        shape = as_list(field(info, "shape", where), f"{where}.shape", lambda v, w: as_int(v, w, minimum=0))
        offsets = as_list(field(info, "data_offsets", where), f"{where}.data_offsets",
                          lambda v, w: as_int(v, w, minimum=0))
        numel = 1
        for n in shape:
            numel *= n
        if len(offsets) != 2 or offsets[1] - offsets[0] != numel * dtype.itemsize or offsets[1] > data_bytes:
            raise ValueError(f"{where}: data_offsets {offsets} do not hold {shape} {info['dtype']} inside the "
                             f"file's {data_bytes} data bytes")
        entries[name] = (dtype, shape, offsets[0], offsets[1])
    spans = sorted((begin, end) for _, _, begin, end in entries.values() if end > begin)
    for (_, end), (begin, _) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError("two tensors share bytes of the file")
    return entries


def map_safetensors(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError("the file is shorter than a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER:
            raise ValueError(f"header of {header_len} bytes is not a safetensors header")
        header = as_dict(json.loads(f.read(header_len)), "header")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base = 8 + header_len
    if base > len(mapped):
        raise ValueError(f"header of {header_len} bytes runs past the end of the file")
    tensors = {}
    for name, (dtype, shape, begin, end) in _entries(header, len(mapped) - base).items():
        if end == begin:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            tensor = torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                      offset=base + begin).view(shape)
        tensors[name] = tensor if device.type == "cpu" else tensor.to(device)
    return tensors
