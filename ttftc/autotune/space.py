"""Search spaces: for an (op, provider) pair, the knobs a lowering exposes and the constraints that prune them.

A lowering that has knobs registers a SearchSpace next to its kernel, and accepts a `tuning_config` keyword (a
dict, or None for its defaults). The tuner times candidates; codegen passes the cached winner at compile time.

One provider can need different spaces on different devices: the Triton kernels have num_warps/num_stages on GPUs
but block sizes and multibuffer under triton-ascend on NPUs. A space registered with a `device_type` serves that
device only; `space_for(op, provider, device_type)` prefers it and falls back to the device-independent space.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

Config = dict[str, Any]
# A constraint returns None when a candidate is allowed for the problem, else why it is pruned.
Constraint = Callable[[Config, "Problem"], Optional[str]]


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        return "x".join(map(str, self.shape)) + ":" + str(self.dtype).replace("torch.", "")


@dataclass(frozen=True)
class Problem:
    """One op instance's concrete shapes and options, as the tuner and the cache see it."""

    op: str
    provider: str
    args: tuple
    kwargs: tuple[tuple[str, Any], ...]

    @staticmethod
    def is_static(args, kwargs: dict) -> bool:
        """False when a shape is symbolic: such a graph serves many sizes and has no single tuned config."""
        values = list(args) + list(kwargs.values())
        return not any(
            isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in v.shape))
            for v in values
        )

    @staticmethod
    def from_meta(op: str, provider: str, args, kwargs: dict) -> "Problem":
        def spec(a):
            if isinstance(a, torch.Tensor):
                return TensorSpec(tuple(int(s) for s in a.shape), a.dtype)
            if isinstance(a, torch.SymInt):
                return int(a)
            return a

        return Problem(op, provider, tuple(spec(a) for a in args), tuple(sorted((k, spec(v)) for k, v in kwargs.items())))

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.kwargs)

    def tensors(self) -> list[TensorSpec]:
        return [a for a in self.args if isinstance(a, TensorSpec)]

    def signature(self) -> str:
        def show(a):
            return a.describe() if isinstance(a, TensorSpec) else repr(a)

        parts = [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs]
        return ",".join(parts)

    def dtype(self) -> str:
        tensors = self.tensors()
        return str(tensors[0].dtype).replace("torch.", "") if tensors else "none"


@dataclass(frozen=True)
class SearchSpace:
    op: str
    provider: str
    axes: dict[str, tuple]  # knob -> values to try
    default: Callable[[Problem], Config]
    constraints: tuple[Constraint, ...] = ()
    # Builds real inputs for timing; defaults to random tensors of the problem's shapes.
    make_inputs: Optional[Callable[[Problem, str], tuple[tuple, dict]]] = None
    notes: str = ""
    device_type: Optional[str] = None  # None: every device the provider runs on; else only this one ("npu")

    def grid(self) -> list[Config]:
        names = list(self.axes)
        return [dict(zip(names, values)) for values in itertools.product(*(self.axes[n] for n in names))]

    def candidates(self, problem: Problem) -> tuple[list[Config], list[tuple[Config, str]]]:
        """(allowed candidates, [(pruned candidate, reason)]), the default always first among the allowed."""
        allowed, pruned = [], []
        default = self.default(problem)
        for config in [default] + [c for c in self.grid() if c != default]:
            reason = next((r for r in (rule(config, problem) for rule in self.constraints) if r), None)
            if reason is None:
                allowed.append(config)
            else:
                pruned.append((config, reason))
        return allowed, pruned


# (op, provider) for device-independent spaces, (op, provider, device_type) for device-specific ones.
_SPACES: dict[tuple, SearchSpace] = {}


def register_space(space: SearchSpace) -> SearchSpace:
    key = (space.op, space.provider) if space.device_type is None else (space.op, space.provider, space.device_type)
    _SPACES[key] = space
    return space


def space_for(op: str, provider: str, device_type: Optional[str] = None) -> Optional[SearchSpace]:
    """The space for `op` under `provider` on `device_type` ("cpu", "cuda", "npu"; an index such as "npu:0" is
    ignored): the device's own space if one is registered, else the device-independent one."""
    if device_type is not None:
        specific = _SPACES.get((op, provider, str(device_type).split(":")[0]))
        if specific is not None:
            return specific
    return _SPACES.get((op, provider))


def all_spaces() -> dict[tuple, SearchSpace]:
    return dict(_SPACES)


# Knobs every machine tunes to its own value (a thread count): any value in this range is a point of the space.
MACHINE_KNOBS = {"num_threads": (1, 1024)}


def tuning_axes(op: str, provider: str) -> Optional[dict[str, tuple]]:
    """Every knob the autotune spaces of (op, provider) define, on any device, with all the values they try."""
    axes: dict[str, tuple] = {}
    for space in _SPACES.values():
        if space.op == op and space.provider == provider:
            for knob, values in space.axes.items():
                axes[knob] = axes.get(knob, ()) + tuple(values)
    return axes or None


def knob_reason(config: Any, axes: Optional[Mapping[str, tuple]]) -> Optional[str]:
    """None when `config` (read from a file: an artifact's graph, a compile-cache entry, an autotune entry) is a point
    of the space whose `axes` are given: known knobs, each with a value its axis tries (or, for a MACHINE_KNOBS knob,
    an int in its range, or None). Else why not. Values reach kernels as block and buffer sizes, so a value no
    tuning run can produce is refused, not clamped."""
    if not isinstance(config, dict):
        return f"a tuned config must be a dict of knobs, got {type(config).__name__}"
    for knob, value in config.items():
        if axes is None or knob not in axes:
            return f"{knob!r} is not a knob of this lowering's autotune space"
        if knob in MACHINE_KNOBS and value is not None:
            low, high = MACHINE_KNOBS[knob]
            if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
                return f"{knob}={value!r} is not an int in [{low}, {high}]"
        elif not any(value == v and type(value) is type(v) for v in axes[knob]):
            return f"{knob}={value!r} is not a value its axis tries {tuple(axes[knob])}"[:200]
    return None


def random_inputs(problem: Problem, device: str) -> tuple[tuple, dict]:
    """Random tensors with the problem's shapes. int8 tensors (quantised weights and activations) span the full
    [-127, 127]: a candidate that is wrong only on large products (a saturating 16-bit pair sum) must fail the
    tuner's check. Other integer tensors (lengths, indices) get small non-negative values."""
    generator = torch.Generator().manual_seed(0)

    def make(a):
        if not isinstance(a, TensorSpec):
            return a
        if a.dtype.is_floating_point:
            return (torch.randn(a.shape, generator=generator) * 0.5).to(device=device, dtype=a.dtype)
        if a.dtype == torch.int8:
            return torch.randint(-127, 128, a.shape, generator=generator, dtype=torch.int8).to(device=device)
        return torch.randint(0, 8, a.shape, generator=generator).to(device=device, dtype=a.dtype)

    return tuple(make(a) for a in problem.args), {k: make(v) for k, v in problem.kwargs}

