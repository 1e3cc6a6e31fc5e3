"""Autotuned configs for a graph with symbolic sizes: looked up per concrete shape when the lowering runs.

`ttftc autotune` stores one config per concrete problem (op, provider, shapes, dtypes, options). A graph traced
with a symbolic prompt length serves every length, so its lowering cannot take one config at compile time; this
wrapper finds the stored config for the shapes of each call, once per distinct shape, and passes it on.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ttftc.autotune.cache import AutotuneCache
from ttftc.autotune.keys import key_for
from ttftc.autotune.space import Problem, tuning_axes

_UNSEEN = object()


class TunedPerShape:
    """Calls `impl` with the autotuned config stored for the concrete shapes of each call (if any)."""

    def __init__(self, op: str, provider: str, device_type: str, impl: Callable, cache):
        self.op, self.provider, self.device_type = op, provider, device_type
        self.impl = impl
        self.cache = cache
        self.configs: dict[tuple, Optional[dict]] = {}
        self.__name__ = getattr(impl, "__name__", type(self).__name__)  # FX names call targets by it
        self.__qualname__ = self.__name__

    @staticmethod
    def _signature(args, kwargs) -> tuple:
        def one(a: Any):
            return (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a

        return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))

    def _config_for(self, args, kwargs) -> Optional[dict]:
        signature = self._signature(args, kwargs)
        config = self.configs.get(signature, _UNSEEN)
        if config is _UNSEEN:
            cache = self.cache if self.cache is not None else AutotuneCache()
            entry = cache.lookup(key_for(Problem.from_meta(self.op, self.provider, args, kwargs), self.device_type),
                                 axes=tuning_axes(self.op, self.provider))
            config = self.configs[signature] = entry.config if entry is not None else None
        return config

    def __call__(self, *args, **kwargs):
        config = self._config_for(args, kwargs)
        return self.impl(*args, **kwargs, tuning_config=config) if config else self.impl(*args, **kwargs)
