"""`ttftc bench MODEL`: TTFT of several variants, interleaved in one process, with a roofline bound."""

from __future__ import annotations

import argparse

DEFAULT_SEQS = "128,512,2048"
DEFAULT_REPEATS = 10
DEFAULT_WARMUP = 1
DEFAULT_PEAK_SIZE = 2048


def parse_seqs(text: str) -> tuple[int, ...]:
    """`128,512,2048` → (128, 512, 2048); anything else is an argparse error (exit status 2)."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"malformed --seq {text!r}: expected positive integers like 128,512,2048")
    seqs = tuple(int(p) for p in parts)
    if any(s <= 0 for s in seqs):
        raise argparse.ArgumentTypeError(f"malformed --seq {text!r}: lengths must be positive")
    if len(set(seqs)) != len(seqs):
        raise argparse.ArgumentTypeError(f"malformed --seq {text!r}: a length is repeated")
    return seqs


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _non_negative(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time to first token of eager, Inductor, torchao and ttftc variants, with a roofline bound",
        description="Measure the prefill (first token) of MODEL under several variants, interleaved in one "
        "process. MODEL is a preset (llama-135m, qwen2-gqa-150m, tiny) or a local Hugging Face model directory.",
    )
    p.add_argument("model", metavar="MODEL", help="preset name or local model directory")
    p.add_argument("--seq", type=parse_seqs, default=parse_seqs(DEFAULT_SEQS), metavar="N[,N...]",
                   help=f"prompt lengths (default {DEFAULT_SEQS})")
    p.add_argument("--variants", metavar="V[,V...]",
                   help="variants to run (default: all of eager-sdpa, eager-attn, inductor, inductor-bf16, "
                   "torchao-int8, ttftc-fp32, ttftc-bf16, ttftc-int8); also ttftc[passes=a+b,precision=bf16], "
                   "with tuned=on|off to compile with or without autotuned kernel configs")
    p.add_argument("--autotune-cache", metavar="DIR", default=None,
                   help="the autotune cache tuned=on variants read (default $TTFTC_AUTOTUNE_CACHE, else "
                   "$TTFTC_CACHE_DIR/autotune, else ~/.cache/ttftc/autotune)")
    p.add_argument("--repeats", type=_positive, default=DEFAULT_REPEATS,
                   help=f"measured runs per variant and length (default {DEFAULT_REPEATS})")
    p.add_argument("--warmup", type=_non_negative, default=DEFAULT_WARMUP,
                   help=f"unmeasured runs after the first call (default {DEFAULT_WARMUP})")
    p.add_argument("--ablation", action="store_true",
                   help="run ttftc with its passes switched on one at a time (instead of the default variants "
                   "unless --variants is given) and print the TTFT of each step")
    p.add_argument("--workload", default=None, help="workload plug-in (default single-prompt)")
    p.add_argument("--first-call", choices=("subprocess", "in-process", "skip"), default="subprocess",
                   help="how first_call_s is measured: a fresh process with empty compile caches per variant and "
                   "length (default), the first call in this process, or not at all")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=_positive, default=None,
                   help="torch intra-op threads (default: torch's choice, one per core)")
    p.add_argument("--peak-size", type=_positive, default=DEFAULT_PEAK_SIZE,
                   help=f"the GEMM peak is measured on size x size x size products (default {DEFAULT_PEAK_SIZE})")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--md", metavar="PATH", help="write a Markdown table")
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG plot of TTFT against length")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run_module="ttftc.commands.bench_run")
