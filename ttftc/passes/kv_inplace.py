"""The kv_inplace pass: an append into a KV buffer that is a graph input is written in place.

A preallocated KV layer (runtime/kv.py GrowableLayer) appends with `buffer[:, :, start:end].copy_(states)`.
AOTAutograd functionalizes that write into a graph input, and with keep_inference_input_mutations it stays in the
graph as

    new = slice_scatter(buf, src, dim, start, end)      # a full copy of the buffer, with src in its slice
    ... slice(new, dim, 0, end) ...                      # attention reads the KV so far
    copy_(buf, new)                                      # at the end: the mutation, a second full copy

which copies the whole buffer twice per layer and per forward, more than the concatenation it replaces. Written
in place it is one copy of `src` into its slice of `buf`, at the slice_scatter's place, and every reader of `new`
reads `buf` itself.

The guard proves, for each slice_scatter:
- its input is a graph input (a placeholder), mutated by exactly one `copy_(buf, new)`, and `new` is what is
  copied back, so after the write `buf` holds exactly `new`;
- `buf` has no other reader: besides the slice_scatter and the copy_ back, its only users are slices whose only
  users are functional `aten.copy` nodes taking them as the destination (the slice gives the copy its shape and
  dtype; the values are all overwritten), so nothing reads `buf`'s old contents after the write, and nothing
  holds a view of `buf` from before it;
- `src` has `buf`'s dtype and device, so the in-place copy converts nothing that slice_scatter would not.
Anything else (two writes into one buffer, a buffer read elsewhere, a write into an intermediate) is left as it
was, with the reason in explain.

Only the eager code generator gets the rewrite: Inductor reinplaces this pattern itself, after ttftc's post-grad
pass, and its lowering expects the functional form.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.fx as fx

from ttftc import fx_utils as gu
from ttftc.passes.base import GraphPass

aten = torch.ops.aten


@dataclass
class KvWrite:
    scatter: fx.Node  # slice_scatter(buf, src, dim, start, end, step)
    buf: fx.Node  # the graph input written
    writeback: Optional[fx.Node] = None  # copy_(buf, scatter)


def _in_inductor() -> bool:
    """Whether the graph is Inductor's post-grad graph: Inductor sets its fake mode around post-grad passes. Read
    from sys.modules: a process that never imported Inductor is not inside an Inductor compile, and importing it
    here would cost every import of the pass pipeline seconds."""
    virtualized = sys.modules.get("torch._inductor.virtualized")
    return virtualized is not None and not isinstance(virtualized.V.fake_mode, virtualized.NullHandler)


def _writebacks(buf: fx.Node) -> list[fx.Node]:
    return [u for u in buf.users if gu.is_call(u, aten.copy_.default) and u.args[0] is buf]


def _is_shape_donor(node: fx.Node, buf: fx.Node) -> bool:
    """A slice of `buf` used only as the destination of functional copies (whose values it does not supply)."""
    return (gu.is_call(node, aten.slice.Tensor) and node.args[0] is buf and len(node.users) > 0
            and all(gu.is_call(u, aten.copy.default) and u.args[0] is node and node not in u.args[1:]
                    and node not in u.kwargs.values() for u in node.users))


def _same_slice(node: fx.Node, slice_args: tuple) -> bool:
    if not gu.is_call(node, aten.slice.Tensor):
        return False
    bound = gu.bound_arguments(node)
    return bound is not None and (node.args[0], bound["dim"], bound["start"], bound["end"], bound["step"]) == slice_args


class KvInplacePass(GraphPass):
    name = "kv_inplace"

    def find(self, gm: fx.GraphModule) -> Iterable[KvWrite]:
        return [KvWrite(n, n.args[0]) for n in gm.graph.nodes
                if gu.is_call(n, aten.slice_scatter.default) and isinstance(n.args[0], fx.Node)
                and n.args[0].op == "placeholder"]

    def guard(self, gm: fx.GraphModule, match: KvWrite) -> Optional[str]:
        scatter, buf = match.scatter, match.buf
        where = f"{scatter.name} into {buf.name}"
        if _in_inductor():
            return f"{where}: Inductor's graph (Inductor reinplaces it itself)"
        writebacks = _writebacks(buf)
        if len(writebacks) != 1 or writebacks[0].args[1] is not scatter:
            return f"{where}: the input is not mutated by exactly one copy_ of this slice_scatter's result"
        writeback = writebacks[0]
        if len(writeback.args) > 2 or writeback.kwargs or writeback.users:
            return f"{where}: the copy_ back has extra arguments or users"
        others = [u for u in buf.users if u is not scatter and u is not writeback and not _is_shape_donor(u, buf)]
        if others:
            return f"{where}: the input has other readers ({', '.join(u.name for u in others[:3])})"
        if list(scatter.args[2:]).count(buf) or buf in scatter.kwargs.values():
            return f"{where}: the input is also an index argument"
        src = scatter.args[1]
        b, s = gu.val(buf), gu.val(src)
        if not isinstance(b, torch.Tensor) or not isinstance(s, torch.Tensor):
            return f"{where}: no tensor metadata for the input or the written value"
        if s.dtype != b.dtype or s.device != b.device:
            return f"{where}: the written value is {s.dtype} on {s.device}, the input {b.dtype} on {b.device}"
        if not gu.tensor_meta_matches(gu.val(scatter), b):
            return f"{where}: the slice_scatter's result does not match the input's shape, dtype or device"
        match.writeback = writeback
        return None

    def replace(self, gm: fx.GraphModule, match: KvWrite) -> None:
        scatter, buf = match.scatter, match.buf
        bound = gu.bound_arguments(scatter)
        if bound is None:
            raise RuntimeError(f"{scatter.name}: slice_scatter arguments do not bind")
        slice_args = (buf, bound["dim"], bound["start"], bound["end"], bound["step"])
        src = scatter.args[1]
        if gu.is_call(src, aten.copy.default) and len(src.args) == 2 and not src.kwargs and _same_slice(src.args[0],
                                                                                                      slice_args):
            # copy(slice(buf) of this very slice, x) only gives x the slice's shape and dtype, which copy_ into that
            # slice does too: write x itself (the functional copy dies unless something else reads it).
            src = src.args[1]
        with gm.graph.inserting_before(scatter):
            dst = gu.call(gm, aten.slice.Tensor, slice_args)
            gu.call(gm, aten.copy_.default, (dst, src))
        # buf now holds what the slice_scatter computed, and nothing writes it again (the guard): its readers read
        # buf itself, and the copy back at the end has nothing left to do.
        gm.graph.erase_node(match.writeback)
        scatter.replace_all_uses_with(buf)
        gm.graph.erase_node(scatter)
