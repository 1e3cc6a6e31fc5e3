"""The accelerators `ttftc explain --device` predicts for: published peak FLOP/s per dtype and memory bandwidth.

The numbers live in devices.json next to this module, each device with the document they come from and a flag
when they are approximate (the Ascend 910B has no vendor data sheet with these figures). Peaks are dense: the
sparsity figures NVIDIA's and AMD's data sheets lead with assume 2:4 structured sparsity, which no ttftc kernel
uses. `kernel_target` names the compile target (ttftc/codegen/triton/targets.json) whose kernel configs apply.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

_DATA = Path(__file__).with_name("devices.json")
PEAK_DTYPES = ("fp32", "tf32", "bf16", "fp16", "int8")


@dataclass(frozen=True)
class DeviceSpec:
    key: str  # "h100"
    name: str
    peak_tflops: dict[str, float]  # dtype -> dense peak, TFLOP/s (TOP/s for int8)
    bandwidth_gb_s: float
    kernel_target: str
    approximate: bool
    source: str

    def peak_flops(self, dtype: str) -> tuple[float, Optional[str]]:
        """(FLOP/s for a GEMM in `dtype`, a note when another dtype's peak stands in for it)."""
        if dtype in self.peak_tflops:
            return self.peak_tflops[dtype] * 1e12, None
        stand_in = "fp16" if "fp16" in self.peak_tflops else max(self.peak_tflops, key=self.peak_tflops.get)
        return (self.peak_tflops[stand_in] * 1e12,
                f"{self.name} has no published {dtype} peak: {dtype} GEMMs are bounded with the {stand_in} peak")

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_gb_s * 1e9


def _parse(key: str, entry: object) -> DeviceSpec:
    where = f"{_DATA.name}: device {key!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not an object")
    expected = set(DeviceSpec.__dataclass_fields__) - {"key"}
    if set(entry) != expected:
        raise ValueError(f"{where} needs exactly the fields {sorted(expected)}, has {sorted(entry)}")
    peaks = entry["peak_tflops"]
    if not isinstance(peaks, dict) or not peaks or set(peaks) - set(PEAK_DTYPES):
        raise ValueError(f"{where}: peak_tflops must map some of {PEAK_DTYPES} to numbers")
    for dtype, value in peaks.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{where}: peak_tflops[{dtype!r}] must be a positive number, got {value!r}")
    bandwidth = entry["bandwidth_gb_s"]
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or bandwidth <= 0:
        raise ValueError(f"{where}: bandwidth_gb_s must be a positive number, got {bandwidth!r}")
    if not isinstance(entry["source"], str) or not entry["source"].strip():
        raise ValueError(f"{where}: every number needs its source")
    return DeviceSpec(key=key, name=str(entry["name"]), peak_tflops={k: float(v) for k, v in peaks.items()},
                      bandwidth_gb_s=float(bandwidth), kernel_target=str(entry["kernel_target"]),
                      approximate=bool(entry["approximate"]), source=entry["source"])


@functools.lru_cache(maxsize=1)
def all_devices() -> dict[str, DeviceSpec]:
    data = json.loads(_DATA.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
        raise ValueError(f"{_DATA.name} has no 'devices' object")
    return {key: _parse(key, entry) for key, entry in data["devices"].items()}


# Words in torch.cuda.get_device_name() that identify a device of devices.json ("NVIDIA H100 80GB HBM3").
# Only the SXM parts are listed: a PCIe or NVL board of the same name has lower peaks, so a name that says
# PCIe or NVL matches nothing rather than a wrong row.
_NAME_WORDS = {"a100": "A100", "h100": "H100", "h200": "H200", "mi300x": "MI300X"}
_OTHER_BOARDS = ("PCIE", "NVL")


def device_for_name(device_name: str) -> Optional[DeviceSpec]:
    """The devices.json entry a GPU's reported name is, or None when none matches it exactly enough."""
    words = device_name.upper().replace("-", " ").split()
    if any(board in word for word in words for board in _OTHER_BOARDS):
        return None
    matches = [key for key, word in _NAME_WORDS.items() if word in words]
    return all_devices()[matches[0]] if len(matches) == 1 else None


def get_device(key: str) -> DeviceSpec:
    devices = all_devices()
    if key not in devices:
        raise ValueError(f"unknown device {key!r}: expected one of {', '.join(devices)}")
    return devices[key]
