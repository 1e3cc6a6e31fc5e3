"""Which passes exist, in pipeline order. Pass modules register their class with @register_pass on import."""

from __future__ import annotations

import importlib
import pkgutil

# Modules of this package that are infrastructure, not passes.
_INFRASTRUCTURE = {"base", "manager", "registry", "graph_utils"}

_PASSES: dict[str, type] = {}
_discovered = False


def register_pass(cls):
    if not getattr(cls, "name", None) or not isinstance(getattr(cls, "order", None), int):
        raise TypeError(f"{cls.__name__} needs a class attribute `name` (str) and `order` (int)")
    existing = _PASSES.get(cls.name)
    if existing is not None and existing is not cls and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"Two passes are named {cls.name!r}: {existing.__qualname__} and {cls.__qualname__}")
    _PASSES[cls.name] = cls
    return cls


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    package = importlib.import_module("ttftc.passes")
    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in _INFRASTRUCTURE and not info.name.startswith("_"):
            importlib.import_module(f"ttftc.passes.{info.name}")
    _discovered = True


def pass_classes() -> list[type]:
    _discover()
    return sorted(_PASSES.values(), key=lambda cls: (cls.order, cls.name))


def pass_names() -> tuple[str, ...]:
    return tuple(cls.name for cls in pass_classes())
