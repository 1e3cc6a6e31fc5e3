"""ttftc's persistent compile cache: compiled bucket graphs, and the compiled KV path's dynamic-shape graphs
(dynamic_graphs.py), on disk, so a second process compiles nothing.

The names below resolve on first use: loading an AOT artifact imports the graph format and the file helpers of this
package, not the compile cache itself.
"""

from __future__ import annotations

from ttftc._lazy import lazy_exports

_LAZY = {
    "CACHE_ENV": "ttftc.cache.store",
    "CompileCache": "ttftc.cache.store",
    "default_cache": "ttftc.cache.store",
    "default_cache_dir": "ttftc.cache.store",
    "GraphFormatError": "ttftc.cache.graph_format",
    "decode_program": "ttftc.cache.graph_format",
    "encode_program": "ttftc.cache.graph_format",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
