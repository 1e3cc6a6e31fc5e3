"""One copy of each frozen constant across all bucket graphs of a model.

Every bucket graph is compiled separately, so passes that build new weights (merged QKV, int8 copies) build
them once per bucket; with nine buckets that would be nine copies. The pool keeps the first tensor with a
given content and hands it to every later graph, so memory and artifacts hold each weight once.
"""

from __future__ import annotations

import torch
import torch.fx as fx

_SAMPLES = 64


def _fingerprint(t: torch.Tensor) -> tuple:
    # A few evenly spaced elements: cheap, and enough to make torch.equal (the real test) rarely needed
    # for tensors that differ.
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return ()
    step = max(1, flat.numel() // _SAMPLES)
    picked = flat[::step][:_SAMPLES]
    if picked.dtype == torch.bfloat16 or picked.dtype.is_floating_point:
        picked = picked.float()
    return tuple(picked.cpu().tolist())


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


class ConstantPool:
    def __init__(self):
        self._by_meta: dict[tuple, list[torch.Tensor]] = {}
        self.tensors: list[torch.Tensor] = []

    def intern(self, t: torch.Tensor) -> torch.Tensor:
        """The pooled tensor equal to `t` (same shape, stride, dtype, device and values), adding `t` if new."""
        meta = (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        candidates = self._by_meta.setdefault(meta, [])
        for c in candidates:
            if _same_storage(c, t):
                return c
        fingerprint = _fingerprint(t)
        for c in candidates:
            if _fingerprint(c) == fingerprint and torch.equal(c, t):
                return c
        candidates.append(t)
        self.tensors.append(t)
        return t

    def intern_graph(self, gm: fx.GraphModule) -> None:
        """Replace every buffer of `gm` by its pooled copy, in place."""
        for name, buf in list(gm.named_buffers(recurse=False)):
            pooled = self.intern(buf)
            if pooled is not buf:
                gm._buffers[name] = pooled
