"""Micro-benchmark of the CPU int8 GEMM choices behind ttftc.int8_linear, at llama-135m prefill shapes.

Every variant runs interleaved with the others in one process (the machine is shared, so absolute times drift);
the report is the median (and min) over rounds and the median's ratio against fp32 `mm` and bf16 `mm` on the
same shape. Ratios above 1 are faster than the baseline.

    python benchmarks/int8_cpu.py [--tokens 512] [--rounds 15] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ttftc.codegen.cpu import int8_linear as cpu_int8
from ttftc.codegen.cpu.int8_linear import int8_gemm, quantize_rows
from ttftc.ops.int8_linear import quantize_per_token

# (name, K, N): hidden 1024, intermediate 2816 at llama-135m.
SHAPES = (("qkvo 1024->1024", 1024, 1024), ("gate_up 1024->5632", 1024, 2 * 2816), ("down 2816->1024", 2816, 1024))


def _blocked(rows: int, xq, xs, w_q, w_s):
    """The cpu lowering's GEMM + epilogue with `rows`-row blocks (its ROW_BLOCK, set for this call only)."""
    saved = cpu_int8.ROW_BLOCK
    cpu_int8.ROW_BLOCK = rows
    try:
        return int8_gemm(xq, xs, w_q, w_s, None, torch.float32)
    finally:
        cpu_int8.ROW_BLOCK = saved


def _variants(m: int, k: int, n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    x_bf16, w_bf16_t = x.bfloat16(), w.bfloat16().t()
    w_t = w.t()
    w_q, w_s = quantize_per_token(w)
    w_q_kmajor = w_q.t().contiguous().t()  # same [N, K] values with w.t() a row-major [K, N]: the layout candidate
    x_q, x_s = quantize_per_token(x)
    return {
        "fp32 mm": lambda: torch.mm(x, w_t),
        "bf16 mm": lambda: torch.mm(x_bf16, w_bf16_t),
        "int_mm, B = t() of row-major [N,K] (used)": lambda: torch._int_mm(x_q, w_q.t()),
        "int_mm, B row-major [K,N] (pre-transposed)": lambda: torch._int_mm(x_q, w_q_kmajor.t()),
        "quantize fp32 rows (reference ops)": lambda: quantize_per_token(x),
        "quantize fp32 rows (cpu lowering)": lambda: quantize_rows(x),
        "int_mm + naive dequant": lambda: torch._int_mm(x_q, w_q.t()).float() * x_s[:, None] * w_s[None, :],
        "int_mm + in-place dequant, one block": lambda: _blocked(1 << 30, x_q, x_s, w_q, w_s),
        "int_mm + in-place dequant, 128-row blocks": lambda: _blocked(128, x_q, x_s, w_q, w_s),
        "W8A8 from fp32 x (quantize + GEMM + dequant)": lambda: int8_gemm(
            *quantize_rows(x), w_q, w_s, None, torch.float32),
        "W8A16 _weight_int8pack_mm (bf16 x)": lambda: torch._weight_int8pack_mm(x_bf16, w_q, w_s.bfloat16()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default). 1 is steadier on a busy shared machine.")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, tokens {args.tokens}")
    for label, k, n in SHAPES:
        variants = _variants(args.tokens, k, n)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():  # warm-up: oneDNN/MKL pick kernels and allocate on first call
            fn()
            fn()
        for _ in range(args.rounds):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) for name, t in times.items()}
        best = {name: min(t) for name, t in times.items()}
        flops = 2 * args.tokens * k * n
        print(f"\n{label}  (M={args.tokens}, K={k}, N={n}; {flops / 1e9:.2f} GFLOP)")
        print(f"  {'variant':<46}{'median ms':>10}{'min ms':>9}{'G(FL)OP/s':>11}{'vs fp32':>9}{'vs bf16':>9}")
        for name, t in med.items():
            print(
                f"  {name:<46}{t * 1e3:>10.3f}{best[name] * 1e3:>9.3f}{flops / t / 1e9:>11.0f}"
                f"{med['fp32 mm'] / t:>8.2f}x{med['bf16 mm'] / t:>8.2f}x"
            )


if __name__ == "__main__":
    main()
