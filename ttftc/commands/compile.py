"""`ttftc compile MODEL -o DIR`: compile every bucket offline into an artifact that `ttftc.load(DIR)` serves."""

from __future__ import annotations

import argparse

from ttftc.config import PRECISIONS


def _int_list(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p.isdigit() or int(p) < 1 for p in parts):
        raise argparse.ArgumentTypeError(f"malformed list {text!r}: expected positive integers like 128,256,512")
    values = tuple(int(p) for p in parts)
    if list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"malformed list {text!r}: values must be increasing, without repeats")
    return values


def _logits_modes(text: str) -> tuple[str, ...]:
    modes = tuple(p.strip() for p in text.split(",") if p.strip())
    if not modes or any(m not in ("last", "all") for m in modes):
        raise argparse.ArgumentTypeError(f"malformed --logits {text!r}: use last, all, or last,all")
    return modes


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compile",
        help="compile a model's prefill for every bucket, offline, into an artifact directory",
        description="Compile MODEL's prefill graphs (one per bucket) with ttftc and write an artifact directory: "
        "manifest.json (versions, checksums, bucket table, tuned kernel configs), weights.safetensors and the "
        "graphs. `ttftc.load(DIR)` serves it with no compilation. MODEL is a preset (llama-135m, "
        "qwen2-gqa-150m, tiny) or a local Hugging Face model directory.",
    )
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="preset name or local model directory (optional with --rebuild)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the artifact directory to write")
    p.add_argument("--buckets", type=_int_list, metavar="N[,N...]",
                   help="prompt-length buckets (default: powers of two 16..4096, capped at the model's positions)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--passes", default="all", help="all (default), none, or pass names separated by commas")
    p.add_argument("--provider", choices=("auto", "reference", "triton", "cpu", "npu"), default="auto")
    p.add_argument("--batch", type=_int_list, default=(1,), metavar="N[,N...]", help="batch sizes (default 1)")
    p.add_argument("--logits", type=_logits_modes, default=("last",), metavar="MODE[,MODE]",
                   help="last (default: the last real token's logits, what a first token needs), all, or last,all")
    p.add_argument("--no-kv", action="store_true", help="do not return the KV cache from the graphs")
    p.add_argument("--rebuild", action="store_true",
                   help="rebuild DIR from the source model and options its manifest records (MODEL overrides "
                        "the recorded model)")
    p.set_defaults(run_module="ttftc.commands.compile_run")
