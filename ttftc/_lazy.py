"""Package attributes resolved on first use (PEP 562), so importing a package does not import what it re-exports."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(namespace: dict[str, Any], table: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list]]:
    """A package's `__getattr__` and `__dir__` for `table` (attribute name -> module defining it)."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
