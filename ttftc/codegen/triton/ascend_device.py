"""What the Triton kernels need to know about an Ascend NPU: core counts (the persistent grid) and on-chip sizes.

The documented Atlas A2 numbers come from targets.json (entry Ascend910B3, with sources); a real device's own
core counts, read through triton-ascend's driver, always win. UNTESTED ON HARDWARE: no NPU was available.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ttftc.codegen.npu import _torch_npu
from ttftc.codegen.triton.targets import Target, get_target


@dataclass(frozen=True)
class AscendDevice:
    """What the pruning rules and the persistent launch need to know about an Ascend NPU."""

    cube_cores: int  # AI (cube) cores: `num_aicore`
    vector_cores: int  # `num_vectorcore`
    ub_bytes: int = 192 * 1024  # Unified Buffer per vector core
    l1_bytes: int = 512 * 1024  # L1 buffer per cube core

    @staticmethod
    def from_target(target: Target) -> "AscendDevice":
        return AscendDevice(target.cube_cores, target.vector_cores, target.unified_buffer_bytes, target.l1_bytes)


# Atlas A2 (Ascend 910B3), used when the device cannot be asked.
ATLAS_A2 = AscendDevice.from_target(get_target("Ascend910B3"))


def query_device() -> AscendDevice:
    """The current NPU's core counts from triton-ascend's driver, else the Atlas A2 numbers."""
    if _torch_npu.load() is None:
        return ATLAS_A2
    try:
        import triton  # lazy: triton-ascend, present only on an Ascend host

        props = triton.runtime.driver.active.utils.get_device_properties(torch.npu.current_device())
        cube, vector = int(props.get("num_aicore", 0)), int(props.get("num_vectorcore", 0))
    except Exception:  # not triton-ascend's driver, or no device: keep the documented numbers
        return ATLAS_A2
    if cube <= 0 or vector <= 0:
        return ATLAS_A2
    return AscendDevice(cube_cores=cube, vector_cores=vector, ub_bytes=ATLAS_A2.ub_bytes, l1_bytes=ATLAS_A2.l1_bytes)


@functools.lru_cache(maxsize=1)
def current_device() -> AscendDevice:
    """query_device(), asked once per process."""
    return query_device()


def launch_grid(device: AscendDevice, uses_dot: bool = True) -> tuple[int]:
    """triton-ascend's grid: one program per physical core (cube cores when the kernel uses tl.dot)."""
    return (device.cube_cores if uses_dot else device.vector_cores,)
