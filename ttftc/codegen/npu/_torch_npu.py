"""The import guard for torch_npu: lowerings ask `load()` and treat None as "not capable".

Not cached, so a test can put a recording stand-in into sys.modules["torch_npu"] and every NPU lowering sees it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional


def load() -> Optional[ModuleType]:
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # ImportError, or a broken CANN install raising at import time
        return None


def unavailable_reason() -> Optional[str]:
    return None if load() is not None else "torch_npu is not importable"


def unsupported_device_reason(ctx) -> Optional[str]:
    """For an NPU lowering's capability check: None when `ctx`'s tensors can go to torch_npu, else why not.

    NPU tensors need a real torch_npu. CPU tensors are accepted only when provider="npu" is forced and the
    loaded module is the test suite's recording stand-in (it sets `ttftc_cpu_standin`): that is how CI runs
    whole models through the NPU lowerings without an NPU, like Triton's interpreter for the Triton ones.
    """
    module = load()
    if module is None:
        return "torch_npu is not importable"
    if ctx.device_type == "npu":
        return None
    if ctx.device_type == "cpu" and ctx.forced_provider == "npu" and getattr(module, "ttftc_cpu_standin", False):
        return None
    return f"tensors are on {ctx.device_type}, not npu"
