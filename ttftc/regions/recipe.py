"""Weight recipes: how each constant a compile derived from a region's weights was computed, replayable on another
region's weights.

Every constant a pass adds (a QKV concatenation, a bf16 cast, an int8 quantisation) is computed with torch calls
on the frozen weights. `WeightRecorder` is a TorchFunctionMode that watches those calls while the passes and the
lowering run: a tensor derived from a source weight is tracked, and each call that reads a tracked tensor is
recorded with its arguments. Afterwards `recipe_for` slices, for the module's buffers, the calls that made them;
`WeightRecipe.replay` runs that slice on other weights and returns the buffers they give.

Replaying is only right when nothing the compile decided depended on the weights' values, only on their shapes
and dtypes. So the recorder marks the recording unsafe on anything that could have let a value reach Python (item,
bool, tolist, numpy, a comparison read out, a data pointer), on a write into a source weight, and on a buffer
whose origin it did not see; an unsafe recording gives no recipe, and the caller compiles each region itself.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

# Calls on a tracked tensor that only read its metadata, never its values.
_METADATA_CALLS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous", "element_size", "storage_offset",
    "__len__", "is_floating_point", "is_complex", "is_signed", "get_device", "is_pinned", "is_shared",
    "is_inference", "has_names", "__hash__", "_is_view", "is_set_to", "is_same_size", "is_nonoverlapping_and_dense",
    "_is_zerotensor", "is_conj", "is_neg", "_nnz",
})
# Property getters (Tensor.shape, .dtype, .device, ...) arrive as `__get__`; those returning a tensor (.data, .T,
# .mT) are ordinary calls.
_GETTER = "__get__"


@dataclass(frozen=True)
class _Ref:
    """A tensor argument of a recorded call: the output `leaf` of recorded call `call` (call -1: source `leaf`)."""

    call: int
    leaf: int


@dataclass
class _Call:
    func: Callable
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list  # flat (args, kwargs): _Ref for tracked tensors, anything else as it was passed
    out_leaves: list  # per output leaf: its _Ref if a tensor, else the value
    mutated: Optional[int] = None  # for a call that writes in place: the leaf it writes into
    storages: tuple = ()  # storage keys of what it produced or wrote into (aliasing, for the slice)
    read: Any = None  # for a call that read weight values into Python: what it read (a _Read)


@dataclass(frozen=True)
class _Read:
    value: Any


class ReplayMismatch(Exception):
    """A value the compile read from its weights differs for the weights being replayed: the compile's decisions
    may differ too, so these weights need a compile of their own."""


MUTATED = -2  # the leaf of a _Ref naming the tensor an in-place call wrote into, as that call left it


@dataclass
class WeightRecipe:
    """The recorded calls that make a module's buffers from its region's weights."""

    source_meta: tuple  # (shape, dtype, device) per source weight
    calls: list[_Call]
    buffers: dict[str, Any]  # buffer name -> _Ref (derived from the sources) or the tensor itself (a constant)

    def matches(self, sources: Sequence[torch.Tensor]) -> Optional[str]:
        """None when `sources` have the shapes, dtypes and devices this recipe was recorded with, else why not."""
        if len(sources) != len(self.source_meta):
            return f"{len(sources)} weights where the recipe has {len(self.source_meta)}"
        for i, (t, meta) in enumerate(zip(sources, self.source_meta)):
            if not isinstance(t, torch.Tensor) or _meta(t) != meta:
                return f"weight {i} differs from the recorded {meta}"
        return None

    def replay(self, sources: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The buffers the recorded calls give for `sources` (weights in the recording's order)."""
        values: dict[_Ref, torch.Tensor] = {_Ref(-1, i): s.detach() for i, s in enumerate(sources)}

        def resolve(x):
            return values[x] if isinstance(x, _Ref) else x

        with torch.no_grad():
            for index, call in enumerate(self.calls):
                flat = [resolve(x) for x in call.leaves]
                args, kwargs = tree_unflatten(flat, call.spec)
                result = call.func(*args, **kwargs)
                if call.read is not None:
                    if not _same_value(result, call.read.value):
                        raise ReplayMismatch(f"{_name(call.func)} read {result!r} where the compile read "
                                             f"{call.read.value!r}")
                    continue
                out_leaves, _ = tree_flatten(result)
                for leaf, (recorded, produced) in enumerate(zip(call.out_leaves, out_leaves)):
                    if isinstance(recorded, _Ref):
                        values[_Ref(index, leaf)] = produced
                if call.mutated is not None:
                    values[_Ref(index, MUTATED)] = flat[call.mutated]
        return {name: resolve(ref) for name, ref in self.buffers.items()}


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN reads as itself


def _plain_value(x: Any) -> bool:
    """A Python value a read can be compared by (what item, bool, int, float and tolist return)."""
    if isinstance(x, (list, tuple)):
        return all(_plain_value(v) for v in x)
    return isinstance(x, (bool, int, float, complex)) or x is None


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _name(func) -> str:
    return getattr(func, "__name__", "") or str(func)


def _mutated_leaf(func, args: tuple, kwargs: dict, leaves: list) -> Optional[int]:
    """The flat position of the tensor an in-place or out= call writes into, else None."""
    name = _name(func)
    if "out" in kwargs:
        target = kwargs["out"]
    elif name == "__setitem__" or (name.startswith("__i") and name.endswith("__")
                                   and name not in ("__index__", "__int__", "__invert__", "__iter__", "__init__")):
        target = args[0] if args else None
    elif name.endswith("_") and not name.startswith("_"):
        target = args[0] if args else None
    else:
        return None
    for i, x in enumerate(leaves):
        if x is target:
            return i
    return None


class WeightRecorder(TorchFunctionMode):
    """Records the torch calls made on `sources`, on everything derived from them, and on the tensors those calls
    were combined with that were made while recording (see the module docstring).

    `unsafe` holds the first reason replay cannot be trusted, or None.
    """

    def __init__(self, sources: Sequence[torch.Tensor]):
        super().__init__()
        self.sources = list(sources)
        self.calls: list[_Call] = []
        self.unsafe: Optional[str] = None
        self.reads = 0  # values read from weights into Python (each checked again on replay)
        # id(tensor) -> its _Ref, dropped when the tensor dies (so that a reused id is not mistaken for it).
        self._refs: dict[int, _Ref] = {}
        self._derived: set[int] = set()  # ids of tensors whose values depend on a source
        self._source_storages = {_storage_key(s) for s in self.sources} - {None}
        for i, s in enumerate(self.sources):
            self._track(s, _Ref(-1, i), derived=True)

    def _track(self, t: torch.Tensor, ref: _Ref, derived: bool) -> None:
        key = id(t)
        if key not in self._refs:
            weakref.finalize(t, self._forget, key)
        self._refs[key] = ref
        if derived:
            self._derived.add(key)
        else:
            self._derived.discard(key)

    def _forget(self, key: int) -> None:
        self._refs.pop(key, None)
        self._derived.discard(key)

    def _flag(self, reason: str) -> None:
        if self.unsafe is None:
            self.unsafe = reason

    def ref_of(self, t: Any) -> Optional[_Ref]:
        return self._refs.get(id(t)) if isinstance(t, torch.Tensor) else None

    def is_derived(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self._derived

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        out_leaves, _ = tree_flatten(result)
        out_tensors = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        derived = any(self.is_derived(x) for x in tensors)
        name = _name(func)
        if not derived:
            # A tensor made from nothing tracked-or-untracked (a factory call: zeros, arange, tensor) is tracked as
            # a constant, so that a later write of weights into it can be replayed. Calls on untracked tensors
            # (the compile's fake tensors, measurements) are none of the recipe's business.
            if out_tensors and all(self.ref_of(x) is not None for x in tensors):
                self._record(func, spec, leaves, out_leaves, None, derived=False)
            return result
        mutated = _mutated_leaf(func, args, kwargs, leaves)
        if mutated is not None:
            if _storage_key(leaves[mutated]) in self._source_storages:
                self._flag(f"{name} wrote into a source weight")
        elif not out_tensors:
            if name in _METADATA_CALLS or name == _GETTER:
                return result
            if not _plain_value(result):
                self._flag(f"a compile step read weight values through {name}, into a {type(result).__name__}")
                return result
            # A value read into Python may have steered a decision: the recipe reads it again on the replayed
            # weights and refuses them where it differs (ReplayMismatch).
            self.calls.append(_Call(func, spec, [self.ref_of(x) or x for x in leaves], [], read=_Read(result)))
            self.reads += 1
            return result
        self._record(func, spec, leaves, out_leaves, mutated, derived=True)
        return result

    def _record(self, func, spec, leaves: list, out_leaves: list, mutated: Optional[int], derived: bool) -> None:
        index = len(self.calls)
        recorded_in = [self.ref_of(x) or x for x in leaves]  # before the outputs are tracked: one may be an input
        recorded_out = []
        storages = []
        for leaf, x in enumerate(out_leaves):
            if isinstance(x, torch.Tensor) and not (mutated is not None and x is leaves[mutated]):
                self._track(x, _Ref(index, leaf), derived)
                recorded_out.append(_Ref(index, leaf))
                storages.append(_storage_key(x))
            else:
                recorded_out.append(x if not isinstance(x, torch.Tensor) else None)
        if mutated is not None:
            target = leaves[mutated]
            self._track(target, _Ref(index, MUTATED), derived or self.is_derived(target))
            storages.append(_storage_key(target))
        self.calls.append(_Call(func, spec, recorded_in, recorded_out, mutated, tuple(storages)))


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (fake, meta): cannot alias a weight
        return None


def recipe_for(recorder: WeightRecorder, buffers: dict[str, torch.Tensor],
               constants: Callable[[torch.Tensor], bool]) -> tuple[Optional[WeightRecipe], Optional[str]]:
    """(recipe, None) for `buffers` (name -> tensor), or (None, why replay is unsafe).

    A buffer is either derived from the sources (its recorded calls are kept) or a constant that `constants`
    vouches for (shared as is); any other buffer has an origin the recorder did not see.
    """
    if recorder.unsafe:
        return None, recorder.unsafe
    wanted: dict[str, Any] = {}
    for name, tensor in buffers.items():
        ref = recorder.ref_of(tensor)
        if ref is not None:
            wanted[name] = ref
        elif constants(tensor):
            wanted[name] = tensor
        else:
            return None, f"buffer {name} was made by a call the recorder did not see"
    reads = [i for i, c in enumerate(recorder.calls) if c.read is not None]
    needed = _slice(recorder.calls, [r for r in wanted.values() if isinstance(r, _Ref)], reads)
    renumber = {old: new for new, old in enumerate(needed)}

    def remap(x):
        return _Ref(renumber[x.call], x.leaf) if isinstance(x, _Ref) and x.call >= 0 else x

    calls = [dataclasses.replace(c, leaves=[remap(x) for x in c.leaves], out_leaves=[remap(x) for x in c.out_leaves])
             for c in (recorder.calls[i] for i in needed)]
    return WeightRecipe(tuple(_meta(s) for s in recorder.sources), calls,
                        {name: remap(r) for name, r in wanted.items()}), None


def _slice(calls: list[_Call], outputs: list[_Ref], roots: list[int]) -> list[int]:
    """Indices, in order, of the calls `roots` and `outputs` depend on: through their arguments, and through writes
    into the storage of a tensor they read (a write through a view is not an argument of the later reader)."""
    needed: set[int] = set()
    stack = [r.call for r in outputs if r.call >= 0] + list(roots)
    while True:
        while stack:
            index = stack.pop()
            if index in needed:
                continue
            needed.add(index)
            stack.extend(x.call for x in calls[index].leaves if isinstance(x, _Ref) and x.call >= 0)
        storages = {key for i in needed for key in calls[i].storages} - {None}
        writers = [i for i, c in enumerate(calls)
                   if c.mutated is not None and i not in needed and storages.intersection(c.storages)]
        if not writers:
            return sorted(needed)
        stack.extend(writers)
