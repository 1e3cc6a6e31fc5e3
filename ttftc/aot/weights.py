"""Read a safetensors file as tensors over a private memory map: no copy at load time.

safetensors' own loader copies every tensor out of the file; mapping it instead makes loading cost nothing
up front (pages come from the page cache when a graph first reads them, and the checksum pass has just put
them there). The mapping is copy-on-write, so the tensors are writable without touching the file.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def map_safetensors(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > 100 << 20:
            raise ValueError(f"header of {header_len} bytes is not a safetensors header")
        header = json.loads(f.read(header_len))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        shape = info["shape"]
        numel = 1
        for n in shape:
            numel *= n
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - begin != numel * itemsize or base + end > len(mapped):
            raise ValueError(f"tensor {name}: {end - begin} bytes do not hold {shape} {info['dtype']}")
        if numel == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            tensor = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=base + begin).view(shape)
        tensors[name] = tensor if device.type == "cpu" else tensor.to(device)
    return tensors
