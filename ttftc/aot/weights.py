"""Read a safetensors file into process memory once, and make its tensors views of that one buffer.

Weights are not memory-mapped: a map ties the loaded model to the file for as long as the model lives. Truncating the
file (a `cp` of a newer artifact over the old one) then kills the next forward with SIGBUS, and rewriting it in
place changes the served weights after their checksum was verified; a copy-on-write map does not help, since a page
the process has not written still reads the file. So `read_file` reads the whole file with one pass of `readinto`
into a buffer the process owns; the caller verifies the checksum on that buffer, and `tensors_in` makes every tensor
a view of it: no copy beyond the read, the bytes checked are the bytes served, and nothing done to the file afterwards
reaches the model.

The header is untrusted (its checksum can be recomputed by whoever wrote it), so every entry is checked before a
tensor is made over the buffer: known dtype, a shape of non-negative ints, offsets inside the data section that hold
exactly that many bytes, and no two tensors sharing bytes. A bad header is a ValueError naming the tensor.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Optional

import torch

from ttftc.cache.schema import as_dict, as_int, as_list, as_str, field

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 << 20


def read_file(path: Path, *, limit: Optional[int] = None) -> torch.Tensor:
    """The bytes of the regular file at `path` as a 1-D uint8 CPU tensor (allocated by torch, so aligned for every
    dtype), read once. A file over `limit` bytes is refused before anything is allocated; a file that shrinks while
    it is read is a ValueError, not a buffer with a zero tail."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb", buffering=0) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if limit is not None and info.st_size > limit:
            raise ValueError(f"{path} holds {info.st_size} bytes, more than the {limit} expected")
        buffer = torch.empty(info.st_size, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        done = 0
        while done < info.st_size:
            got = f.readinto(view[done:])
            if not got:
                raise ValueError(f"{path} shrank from {info.st_size} to {done} bytes while it was read")
            done += got
    return buffer


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


def tensors_in(buffer: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file whose bytes `buffer` (from `read_file`) holds; on the CPU, views of it."""
    if buffer.numel() < 8:
        raise ValueError("the file is shorter than a safetensors header")
    (header_len,) = struct.unpack("<Q", buffer[:8].numpy().tobytes())
    if header_len > _MAX_HEADER:
        raise ValueError(f"header of {header_len} bytes is not a safetensors header")
    base = 8 + header_len
    if base > buffer.numel():
        raise ValueError(f"header of {header_len} bytes runs past the end of the file")
    header = as_dict(json.loads(buffer[8:base].numpy().tobytes()), "header")
    tensors = {}
    for name, (dtype, shape, begin, end) in _entries(header, buffer.numel() - base).items():
        raw = buffer[base + begin:base + end]
        if (base + begin) % dtype.itemsize:
            raw = raw.clone()  # a view needs its dtype's alignment: safetensors' writer keeps it, a crafted file not
        tensor = raw.view(dtype).view(shape)
        tensors[name] = tensor if device.type == "cpu" else tensor.to(device)
    return tensors

