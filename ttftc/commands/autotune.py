"""`ttftc autotune MODEL`: tune every ttftc kernel the model compiles to, per bucket, into a persistent cache.

    ttftc autotune llama-135m --buckets 512,2048 --budget-s 300 --cache DIR
    ttftc autotune llama-135m --buckets 512,2048 --chunk-sizes 256,512,1024   # also chunked prefill's chunk size
    ttftc autotune --show [--cache DIR]
    ttftc autotune --cpu                                       # measure this machine's CPU defaults again

Later compiles read the cache automatically ($TTFTC_AUTOTUNE_CACHE, default ~/.cache/ttftc/autotune), and so does
ttftc.runtime.PrefillEngine for its chunk size when it is given none. The CPU defaults (int8 GEMM, GEMM backends,
attention kernels, native bf16) are measured once per machine and kept in $TTFTC_CACHE_DIR/machine/choices.json;
--cpu measures them again and overwrites that record.

"""

from __future__ import annotations

import argparse

from ttftc.config import PRECISIONS


def _buckets(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"malformed --buckets {text!r}: expected positive integers like 512,2048")
    return tuple(sorted(set(int(p) for p in parts)))


def _chunk_sizes(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"malformed --chunk-sizes {text!r}: expected positive integers like 256,512")
    return tuple(sorted(set(int(p) for p in parts)))


def _ops(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "autotune",
        help="search kernel configs per op and bucket, and store the winners in a persistent cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", nargs="?", help="preset name or local model directory")
    p.add_argument("--buckets", type=_buckets, default=(512,), help="prompt lengths to tune for (default 512)")
    p.add_argument("--budget-s", type=float, default=300.0, help="time budget for the search, seconds")
    p.add_argument("--cache", default=None, help="cache directory (default $TTFTC_AUTOTUNE_CACHE or "
                   "~/.cache/ttftc/autotune)")
    p.add_argument("--ops", type=_ops, default=None, help="only these ttftc ops, comma-separated")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--provider", choices=("auto", "triton", "cpu", "npu"), default="auto")
    p.add_argument("--chunk-sizes", type=_chunk_sizes, default=None,
                   help="also time chunked prefill (ttftc.runtime.PrefillEngine) at each bucket with these chunk "
                   "sizes and the whole prompt, and cache the fastest")
    p.add_argument("--retune", action="store_true", help="measure again even where the cache has an entry")
    p.add_argument("--show", action="store_true", help="list the cache's contents and exit")
    p.add_argument("--cpu", action="store_true",
                   help="measure this machine's CPU defaults again (int8 GEMM, GEMM backends, attention kernels, "
                   "native bf16), overwrite their stored record, print them; then tune MODEL if one is given")
    p.set_defaults(run_module="ttftc.commands.autotune_run")
