"""The CPU GEMM backends of ttftc/codegen/cpu/_blas.py at llama-135m shapes: MKL BLAS (one GEMM over a merged weight,
separate GEMMs, column blocks into one buffer) against oneDNN (merged and separate), plus both at 2048³ in GFLOP/s.

    python benchmarks/wide_gemm_cpu.py [--tokens 512] [--rounds 15] [--dtype fp32|bf16]

Interleaved rounds in one process, medians. This is the measurement behind _blas.py's default backend and
DEFAULT_N_BLOCK.
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
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    hidden, inter = 1024, 2816
    x = torch.randn(args.tokens, hidden, dtype=dtype)
    qkv = [torch.randn(hidden, hidden, dtype=dtype) for _ in range(3)]
    gate_up = [torch.randn(inter, hidden, dtype=dtype) for _ in range(2)]
    cases = {}
    for name, parts in (("q|k|v", qkv), ("gate|up", gate_up)):
        merged = torch.cat(parts)
        cases[f"{name} blas separate"] = lambda parts=parts: [linear_2d(x, w, None) for w in parts]
        for n_block in (0, 512, 1024, 2048):
            cases[f"{name} blas merged n_block={n_block}"] = lambda m=merged, nb=n_block: linear_2d(x, m, None, nb)
        cases[f"{name} onednn separate"] = lambda parts=parts: [linear_2d(x, w, None, gemm="onednn") for w in parts]
        cases[f"{name} onednn merged"] = lambda m=merged: linear_2d(x, m, None, gemm="onednn")
    square = torch.randn(2048, 2048, dtype=dtype)
    square_flops = 2 * 2048**3
    cases["2048^3 blas"] = lambda: linear_2d(square, square, None)
    cases["2048^3 onednn"] = lambda: linear_2d(square, square, None, gemm="onednn")
    times = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(args.rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    for name, samples in times.items():
        ms = statistics.median(samples)
        rate = f"  {square_flops / ms / 1e6:6.0f} GFLOP/s" if name.startswith("2048^3") else ""
        print(f"{name:32s} {ms:8.2f} ms{rate}")


if __name__ == "__main__":
    main()
