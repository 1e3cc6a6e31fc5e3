"""`ttftc bench` run: what the parsed arguments of ttftc/commands/bench.py do."""

from __future__ import annotations

import logging
import sys

import torch

from ttftc.bench import report
from ttftc.bench.runner import BenchSettings, run_bench
from ttftc.bench.variants import DEFAULT_VARIANTS, split_variant_list
from ttftc.bench.workloads import DEFAULT_WORKLOAD
from ttftc.commands import UsageError
from ttftc.models import ModelInputError


def _quiet_third_party_logs() -> None:
    # torchao, imported by transformers when present, warns on CPU-only machines about CUDA kernels it cannot
    # load, and torch warns about torchao's enum registration: noise that would bury the bench's own output.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run(args) -> int:
    _quiet_third_party_logs()
    if args.plot:
        if not args.plot.lower().endswith(".png"):
            raise UsageError(f"--plot {args.plot!r}: the plot is a PNG, give a path ending in .png")
        missing = report.plot_available()
        if missing:
            raise UsageError(missing)
    if args.device not in ("cpu", "cuda"):
        raise UsageError(f"unknown --device {args.device!r}; devices: cpu, cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but torch sees no CUDA device")
    if args.threads is not None:
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
