"""One GEMM over a merged (wide) weight vs separate GEMMs vs column blocks into one buffer, at llama-135m shapes.

    python benchmarks/wide_gemm_cpu.py [--tokens 512] [--rounds 15]

Interleaved rounds in one process, medians. This is the measurement behind ttftc/codegen/cpu/_blas.DEFAULT_N_BLOCK.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ttftc.codegen.cpu._blas import linear_2d


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    hidden, inter = 1024, 2816
    x = torch.randn(args.tokens, hidden)
    qkv = [torch.randn(hidden, hidden) for _ in range(3)]
    gate_up = [torch.randn(inter, hidden) for _ in range(2)]
    cases = {}
    for name, parts in (("q|k|v", qkv), ("gate|up", gate_up)):
        merged = torch.cat(parts)
        cases[f"{name} separate"] = lambda parts=parts: [linear_2d(x, w, None) for w in parts]
        for n_block in (0, 512, 1024, 2048):
            cases[f"{name} merged n_block={n_block}"] = lambda m=merged, nb=n_block: linear_2d(x, m, None, nb)
    times = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(args.rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    for name, samples in times.items():
        print(f"{name:32s} {statistics.median(samples):8.2f} ms")


if __name__ == "__main__":
    main()
