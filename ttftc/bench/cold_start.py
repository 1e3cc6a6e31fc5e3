"""The first call with cold compile caches, measured in a fresh process.

    python -m ttftc.bench.cold_start --model-dir DIR --variant NAME --seq N [--device cpu]

The parent (`measure_cold_first_call`) starts this with every compile cache pointed at a new, empty directory
(see caches.py). Here the model is loaded and the variant built (neither is timed: a server does both before
it takes traffic), then one prefill of N tokens is timed: Dynamo tracing, compilation and the run itself.
Python start-up, imports and model loading are excluded. The last line on stdout is a JSON object, either
{"first_call_s": seconds} or {"error": "reason"}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Optional

import torch

from ttftc.bench.caches import cache_env
from ttftc.bench.models import ModelSource, ModelSpec, example_prompt
from ttftc.bench.timing import time_call
from ttftc.bench.variants import get_variant


def _measure(model_dir: str, variant_name: str, seq: int, device: str) -> float:
    source = ModelSource(ModelSpec(name=model_dir, directory=model_dir), device)
    prepared = get_variant(variant_name).build(source)
    ids = example_prompt(source.config.vocab_size, seq, device=device)
    with torch.inference_mode():
        return time_call(prepared.prefill, ids, device=device)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ttftc.bench.cold_start")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--variant", required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (the parent's count)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        seconds = _measure(args.model_dir, args.variant, args.seq, args.device)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}), flush=True)
        return 1
    print(json.dumps({"first_call_s": seconds}), flush=True)
    return 0


def measure_cold_first_call(
    model_dir: str, variant: str, seq: int, *, device: str = "cpu", timeout_s: float = 600.0
) -> tuple[Optional[float], Optional[str]]:
    """(seconds, None) or (None, reason), from a fresh process with empty compile caches and this process's
    thread count."""
    with tempfile.TemporaryDirectory(prefix="ttftc-cold-") as root:
        env = {**os.environ, **cache_env(root)}
        command = [sys.executable, "-m", "ttftc.bench.cold_start", "--model-dir", model_dir, "--variant", variant,
                   "--seq", str(seq), "--device", device, "--threads", str(torch.get_num_threads())]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout_s:.0f} s"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        try:
            answer = json.loads(lines[-1])
        except json.JSONDecodeError:
            answer = {}
        if "first_call_s" in answer:
            return float(answer["first_call_s"]), None
        if "error" in answer:
            return None, str(answer["error"])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return None, f"exit status {done.returncode}: {tail[:300]}"


if __name__ == "__main__":
    sys.exit(main())
