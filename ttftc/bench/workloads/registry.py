"""Which workloads exist. Modules of this package register their Workload subclass on import."""

from __future__ import annotations

import importlib
import pkgutil

from ttftc.bench.errors import BenchInputError
from ttftc.bench.workloads.base import Workload

# Modules of this package that are infrastructure, not workloads.
_INFRASTRUCTURE = {"base", "registry", "replay", "request"}

_WORKLOADS: dict[str, type[Workload]] = {}
_discovered = False


def register_workload(cls: type[Workload]) -> type[Workload]:
    if not isinstance(cls, type) or not issubclass(cls, Workload):
        raise TypeError(f"{cls!r} is not a subclass of ttftc.bench.workloads.Workload")
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a class attribute `name`")
    existing = _WORKLOADS.get(cls.name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"two workloads are named {cls.name!r}: {existing.__qualname__} and {cls.__qualname__}")
    _WORKLOADS[cls.name] = cls
    return cls


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    package = importlib.import_module("ttftc.bench.workloads")
    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in _INFRASTRUCTURE and not info.name.startswith("_"):
            importlib.import_module(f"ttftc.bench.workloads.{info.name}")
    _discovered = True


def workload_names() -> tuple[str, ...]:
    _discover()
    return tuple(sorted(_WORKLOADS))


def get_workload(name: str) -> Workload:
    _discover()
    if name not in _WORKLOADS:
        raise BenchInputError(f"unknown workload {name!r}; workloads: {', '.join(workload_names())}")
    return _WORKLOADS[name]()
