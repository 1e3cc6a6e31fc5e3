"""The compile targets of the Triton kernels and their hardware limits, read from targets.json (data with sources).

A Target is what the search-space pruning rules and `ttftc kernels` need to know about one device: which Triton
backend compiles for it, its architecture, and the limits a kernel config must fit (shared memory per block on
GPUs; Unified Buffer, L1 and core counts on Ascend). The numbers live in targets.json next to this module, each
with the document it comes from; this module only reads and checks them.

`current_target()` maps the GPU torch sees to its table entry (by compute capability or gfx name) without touching
`triton.runtime.driver`, which raises on a machine with no GPU.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

_DATA = Path(__file__).with_name("targets.json")
BACKENDS = ("cuda", "hip", "npu")


@dataclass(frozen=True)
class Target:
    name: str  # "sm_90", "gfx942", "Ascend910B3"
    device: str  # the product the limits are for
    backend: str  # Triton's backend name: cuda | hip | npu
    arch: Union[int, str]  # 90 for cuda; "gfx942" for hip; "Ascend910B3" for npu
    warp_size: int
    source: str
    shared_memory_per_block: int = 0  # bytes one program may use (GPUs)
    shared_memory_per_multiprocessor: int = 0
    max_registers_per_thread: int = 0
    unified_buffer_bytes: int = 0  # Ascend: per vector core
    l1_bytes: int = 0  # Ascend: per cube core
    cube_cores: int = 0
    vector_cores: int = 0

    @property
    def is_gpu(self) -> bool:
        return self.backend in ("cuda", "hip")


_INT_FIELDS = ("warp_size", "shared_memory_per_block", "shared_memory_per_multiprocessor", "max_registers_per_thread",
               "unified_buffer_bytes", "l1_bytes", "cube_cores", "vector_cores")


def _parse(name: str, entry: object) -> Target:
    where = f"{_DATA.name}: target {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not an object")
    unknown = set(entry) - (set(Target.__dataclass_fields__) - {"name"})
    if unknown:
        raise ValueError(f"{where} has unknown fields {sorted(unknown)}")
    for key in ("device", "backend", "arch", "warp_size", "source"):
        if key not in entry:
            raise ValueError(f"{where} lacks {key!r}")
    if entry["backend"] not in BACKENDS:
        raise ValueError(f"{where}: backend {entry['backend']!r} is not one of {BACKENDS}")
    for key in _INT_FIELDS:
        value = entry.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {key} must be a non-negative integer, got {value!r}")
    if not isinstance(entry["source"], str) or not entry["source"].strip():
        raise ValueError(f"{where}: every number needs its source")
    target = Target(name=name, **entry)
    if target.is_gpu and target.shared_memory_per_block <= 0:
        raise ValueError(f"{where}: a GPU target needs shared_memory_per_block")
    if target.backend == "npu" and not (target.unified_buffer_bytes and target.cube_cores and target.vector_cores):
        raise ValueError(f"{where}: an Ascend target needs unified_buffer_bytes, cube_cores and vector_cores")
    return target


@functools.lru_cache(maxsize=1)
def all_targets() -> dict[str, Target]:
    data = json.loads(_DATA.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("targets"), dict):
        raise ValueError(f"{_DATA.name} has no 'targets' object")
    return {name: _parse(name, entry) for name, entry in data["targets"].items()}


def get_target(name: str) -> Target:
    targets = all_targets()
    if name not in targets:
        raise ValueError(f"unknown target {name!r}: expected one of {', '.join(targets)}")
    return targets[name]


def gpu_targets() -> list[Target]:
    return [t for t in all_targets().values() if t.is_gpu]


def triton_gpu_target(target: Target):
    """triton's GPUTarget for `target` (imported here so that this module stays importable without triton)."""
    from triton.backends.compiler import GPUTarget  # lazy: this module is read where triton is absent

    return GPUTarget(target.backend, target.arch, target.warp_size)


def current_target() -> Optional[Target]:
    """The table entry of the GPU torch uses now; a GPU the table lacks gets its own limits from the driver;
    None without a GPU."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if torch.version.hip:
        name = str(getattr(props, "gcnArchName", "")).split(":")[0]
        backend, arch, warp = "hip", name, 64
    else:
        name = f"sm_{props.major}{props.minor}"
        backend, arch, warp = "cuda", props.major * 10 + props.minor, 32
    known = all_targets().get(name)
    if known is not None:
        return known
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0))
    return Target(name=name, device=props.name, backend=backend, arch=arch, warp_size=warp,
                  source="queried from the device (not in targets.json)", shared_memory_per_block=smem)
