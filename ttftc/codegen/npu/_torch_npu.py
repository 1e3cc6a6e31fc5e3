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
