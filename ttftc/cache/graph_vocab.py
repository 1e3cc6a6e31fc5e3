"""A stored graph's token embedding has a row for every token id its loader admits.

Token ids are checked against a vocabulary size before a graph runs (an artifact's manifest records it; a compiled
model's is its embedding's rows). A table with fewer rows, or a manifest that claims more ids than the table has,
passes an id the table has no row for, and `aten.embedding` raises IndexError at the first call that uses it. So at
load, every embedding the graph's token ids reach (directly, or through ops that keep their values: views, copies)
must look up a stored constant (directly, or through copies that keep its rows) of at least that many rows.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from ttftc.cache.graph_calls import GraphFormatError, Ref

_aten = torch.ops.aten
_EMBEDDING = _aten.embedding.default
# Ops whose result holds their first argument's values: token ids pass through them unchanged.
_KEEP_VALUES = frozenset({
    _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.unsqueeze.default,
    _aten.squeeze.dim, _aten.squeeze.default, _aten.expand.default, _aten.flatten.using_ints, _aten.slice.Tensor,
    _aten.select.int, _aten.clone.default, _aten._to_copy.default, _aten.alias.default,
})
# Ops whose result has their first argument's rows: a table copied or cast on its way to the embedding.
_KEEP_ROWS = frozenset({_aten._to_copy.default, _aten.clone.default, _aten.alias.default, _aten.detach.default,
                        _aten.lift_fresh_copy.default})


def _argument(node: Any, index: int, name: str) -> Any:
    return node.args[index] if len(node.args) > index else (node.kwargs or {}).get(name)


def _table_rows(ref: Any, by_name: Mapping[str, Any], constants: Mapping[str, Any]) -> Optional[int]:
    """The rows of the stored constant `ref` reads (through row-keeping copies), None when it is computed."""
    while isinstance(ref, Ref):
        node = by_name[ref.name]
        if node.kind == "get_attr":
            table = constants[node.target].tensor
            return int(table.shape[0]) if table.dim() == 2 else None
        if node.kind != "call_function" or node.target not in _KEEP_ROWS:
            return None
        ref = _argument(node, 0, "self")
    return None


def check_embedding_rows(spec: Any, vocab_size: int, id_placeholders: Optional[set] = None) -> None:
    """GraphFormatError unless every embedding the token ids of `spec` (a graph_format.ProgramSpec, or any spec with
    `nodes` and `constants`) reach has at least `vocab_size` rows; the ids are the placeholder named `input_ids` in
    spec.inputs, or the placeholders named in `id_placeholders`."""
    if id_placeholders is None:
        placeholders = [node.name for node in spec.nodes if node.kind == "placeholder"]
        ids = {placeholders[spec.inputs.index("input_ids")]}
    else:
        ids = set(id_placeholders)
    by_name = {node.name: node for node in spec.nodes}
    for node in spec.nodes:
        if node.kind != "call_function":
            continue
        source = _argument(node, 0, "self")
        if node.target in _KEEP_VALUES and isinstance(source, Ref) and source.name in ids:
            ids.add(node.name)
            continue
        indices = _argument(node, 1, "indices")
        if node.target is not _EMBEDDING or not (isinstance(indices, Ref) and indices.name in ids):
            continue
        rows = _table_rows(_argument(node, 0, "weight"), by_name, spec.constants)
        if rows is None:
            raise GraphFormatError(f"node {node.name}: the token embedding's table is not a stored [rows, width] "
                                   f"constant, so its rows cannot be checked against the {vocab_size} token ids")
        if rows < vocab_size:
            raise GraphFormatError(f"node {node.name}: the token embedding has {rows} rows, but {vocab_size} token "
                                   f"ids are admitted (an id from {rows} on would have no row)")
