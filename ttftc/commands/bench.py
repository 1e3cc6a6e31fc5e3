"""`ttftc bench MODEL`: TTFT of several variants, interleaved in one process, with a roofline bound."""

from __future__ import annotations

import argparse
import sys

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
    p.set_defaults(run=run)


def _quiet_third_party_logs() -> None:
    # torchao, imported by transformers when present, warns on CPU-only machines about CUDA kernels it cannot
    # load, and torch warns about torchao's enum registration: noise that would bury the bench's own output.
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run(args) -> int:
    from ttftc.bench import BenchSettings, run_bench
    from ttftc.models import ModelInputError
    from ttftc.bench import report
    from ttftc.bench.variants import DEFAULT_VARIANTS, split_variant_list
    from ttftc.bench.workloads import DEFAULT_WORKLOAD
    from ttftc.commands import UsageError

    _quiet_third_party_logs()
    if args.plot:
        if not args.plot.lower().endswith(".png"):
            raise UsageError(f"--plot {args.plot!r}: the plot is a PNG, give a path ending in .png")
        missing = report.plot_available()
        if missing:
            raise UsageError(missing)
    if args.device not in ("cpu", "cuda"):
        raise UsageError(f"unknown --device {args.device!r}; devices: cpu, cuda")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but torch sees no CUDA device")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        if args.variants is not None:
            variants = tuple(split_variant_list(args.variants))
        else:
            variants = () if args.ablation else DEFAULT_VARIANTS
        settings = BenchSettings(
            model=args.model,
            seqs=args.seq,
            variants=variants,
            repeats=args.repeats,
            warmup=args.warmup,
            ablation=args.ablation,
            workload=args.workload or DEFAULT_WORKLOAD,
            first_call=args.first_call,
            device=args.device,
            peak_size=args.peak_size,
            progress=not args.no_progress,
            autotune_cache=args.autotune_cache,
        )
        doc = run_bench(settings)
    except ModelInputError as exc:  # BenchInputError included
        raise UsageError(str(exc)) from None
    print("\n".join(report.summary_lines(doc)))
    if doc.get("ablation"):
        print("\nablation (ttftc passes switched on one at a time, in pipeline order):")
        print(report.ablation_table(doc))
    if args.json:
        report.write_json(doc, args.json)
    if args.md:
        report.write_markdown(doc, args.md)
    if args.plot:
        report.write_plot(doc, args.plot)
    written = [p for p in (args.json, args.md, args.plot) if p]
    if written:
        print(f"wrote {', '.join(written)}", file=sys.stderr)
    return 0
