"""`ttftc explain MODEL`: what every ttftc pass did to MODEL's prefill graph at one prompt length."""

from __future__ import annotations

import argparse


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"malformed --seq {text!r}: expected one positive integer")
    return int(text)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "explain",
        help="print ttftc's pass matches, rejections, op counts and lowering for a model's prefill",
        description="Compile MODEL's prefill (batch 1, logits of the last token) with ttftc at one prompt "
        "length and print the explain table. MODEL is a preset or a local Hugging Face model directory.",
    )
    p.add_argument("model", metavar="MODEL", help="preset name or local model directory")
    p.add_argument("--seq", type=_positive, default=128, help="prompt length (default 128)")
    p.add_argument("--precision", choices=("fp32", "bf16", "int8"), default="fp32")
    p.add_argument("--passes", default="all", help="all (default), none, or pass names separated by commas")
    p.add_argument("--provider", choices=("auto", "reference", "triton", "cpu", "npu"), default="auto")
    # Checked against ttftc/bench/devices.json by the run module: `ttftc --help` must not import the bench package.
    p.add_argument("--device", default=None, metavar="a100|h100|mi300x|910b",
                   help="predict TTFT on this accelerator from the graph's FLOPs and bytes and its published peaks "
                   "(ttftc/bench/devices.json), with per-op bounds and the kernel configs its target would get")
    p.set_defaults(run_module="ttftc.commands.explain_run")
