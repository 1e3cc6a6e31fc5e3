"""ttftc's persistent compile cache: compiled bucket graphs on disk, so a second process compiles nothing."""

from ttftc.cache.graph_format import GraphFormatError, decode_program, encode_program
from ttftc.cache.store import CACHE_ENV, CompileCache, default_cache, default_cache_dir

__all__ = [
    "CACHE_ENV", "CompileCache", "GraphFormatError", "decode_program", "default_cache", "default_cache_dir",
    "encode_program",
]
