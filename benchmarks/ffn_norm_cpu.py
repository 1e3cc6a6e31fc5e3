"""Micro-benchmark of the CPU choices behind ttftc.gated_ffn, ttftc.norm_linear and ttftc.norm at llama-135m
prefill shapes (hidden 1024, intermediate 2816, 512 tokens).

Every variant of one group runs interleaved with the others in one process (the machine is shared, so absolute
times drift); the report is the median over rounds and the ratio against the group's first variant (the eager
decomposition as Hugging Face runs it).

Findings that shaped ttftc/codegen/cpu (figures, CPU and date in benchmarks/README.md, FFN and norms): merged
gate|up with in-place act*mul beat eager, and merged q|k|v beat three GEMMs; the weight layout (a contiguous [K, N]
copy vs the transposed view of [N, K]) and MKL's packed `_mkl_linear` make no difference beyond noise, so the
lowerings keep the frozen weights as they are (no compile-time copy).

    python benchmarks/ffn_norm_cpu.py [--tokens 512] [--rounds 15] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, EPS = 1024, 2816, 1e-6


def _hf_rms(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _groups(tokens: int, dtype: torch.dtype) -> dict[str, dict]:
    from ttftc.codegen.cpu import ffn as cpu_ffn
    from ttftc.codegen.cpu import norm as cpu_norm
    from ttftc.codegen.cpu import norm_linear as cpu_norm_linear

    g = torch.Generator().manual_seed(0)
    h, i = HIDDEN, INTERMEDIATE

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x, res, norm_w = rnd(tokens, h), rnd(tokens, h), rnd(h) + 1
    wq, wk, wv = rnd(h, h, scale=0.03), rnd(h, h, scale=0.03), rnd(h, h, scale=0.03)
    w_qkv = torch.cat([wq, wk, wv])
    w_qkv_t = w_qkv.t().contiguous()
    wg, wu, wd = rnd(i, h, scale=0.03), rnd(i, h, scale=0.03), rnd(h, i, scale=0.03)
    w_gu = torch.cat([wg, wu])
    w_gu_t, wd_t = w_gu.t().contiguous(), wd.t().contiguous()
    gate_up_buf = torch.empty(tokens, 2 * i, dtype=dtype)
    mkl = dtype == torch.float32 and torch.backends.mkl.is_available()
    if mkl:
        w_gu_mkl = torch.ops.mkl._mkl_reorder_linear_weight(w_gu, tokens)
        wd_mkl = torch.ops.mkl._mkl_reorder_linear_weight(wd, tokens)
        w_qkv_mkl = torch.ops.mkl._mkl_reorder_linear_weight(w_qkv, tokens)

    def ffn_eager():
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    def ffn_merged_views():
        gu = torch.mm(x, w_gu.t())
        return torch.mm(F.silu(gu[:, :i]) * gu[:, i:], wd.t())

    def ffn_merged_inplace(wgu=w_gu_t, wdown=wd_t):
        gu = torch.mm(x, wgu, out=gate_up_buf)
        gate = gu[:, :i]
        torch.nn.functional.silu(gate, inplace=True)
        gate.mul_(gu[:, i:])
        return torch.mm(gate, wdown)

    ffn = {
        "eager: 3 linears + silu + mul": ffn_eager,
        "merged mm (W^T views) + silu*mul": ffn_merged_views,
        "merged mm (W^T contiguous) + in-place silu*mul": ffn_merged_inplace,
        "merged mm (W [N,K] view) + in-place silu*mul": lambda: ffn_merged_inplace(w_gu.t(), wd.t()),
        "ttftc cpu gated_ffn": lambda: cpu_ffn.gated_ffn_cpu(x, w_gu, wd, act="silu"),
    }
    if mkl:
        ffn["mkl packed linear + in-place silu*mul"] = lambda: _mkl_ffn(x, w_gu_mkl, w_gu, wd_mkl, wd, tokens, i)

    def qkv_eager():
        y = _hf_rms(x, norm_w)
        return F.linear(y, wq), F.linear(y, wk), F.linear(y, wv)

    def qkv_merged(norm, w_t):
        out = torch.mm(norm(x, norm_w), w_t)
        return out[:, :h], out[:, h : 2 * h], out[:, 2 * h :]

    qkv = {
        "eager: HF rmsnorm + 3 linears": qkv_eager,
        "HF rmsnorm + merged mm (W^T view)": lambda: qkv_merged(_hf_rms, w_qkv.t()),
        "HF rmsnorm + merged mm (W^T contiguous)": lambda: qkv_merged(_hf_rms, w_qkv_t),
        "torch.rms_norm + merged mm (W^T contiguous)": lambda: qkv_merged(
            lambda a, w: torch.rms_norm(a, (h,), w, EPS), w_qkv_t
        ),
        "ttftc cpu norm_linear": lambda: cpu_norm_linear.norm_linear_cpu(
            x, norm_w, None, w_qkv, None, None, kind="rms", eps=EPS
        ),
    }
    if mkl:
        qkv["torch.rms_norm + mkl packed linear"] = lambda: torch.ops.mkl._mkl_linear(
            torch.rms_norm(x, (h,), norm_w, EPS), w_qkv_mkl, w_qkv, None, tokens
        )

    norm = {
        "eager: add + HF rmsnorm": lambda: _hf_rms(x + res, norm_w),
        "add + torch.rms_norm": lambda: torch.rms_norm(x + res, (h,), norm_w, EPS),
        "ttftc cpu norm (residual)": lambda: cpu_norm.norm_cpu(x, norm_w, None, res, kind="rms", eps=EPS),
        "eager: add + layer_norm": lambda: F.layer_norm(x + res, (h,), norm_w, norm_w, 1e-5),
    }
    return {"gated FFN (gate|up, act, down)": ffn, "RMSNorm + QKV": qkv, "residual add + RMSNorm": norm}


def _mkl_ffn(x, w_gu_packed, w_gu, wd_packed, wd, tokens, i):
    gu = torch.ops.mkl._mkl_linear(x, w_gu_packed, w_gu, None, tokens)
    gate = gu[:, :i]
    torch.nn.functional.silu(gate, inplace=True)
    gate.mul_(gu[:, i:])
    return torch.ops.mkl._mkl_linear(gate.contiguous(), wd_packed, wd, None, tokens)


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens, {args.dtype}")
    with torch.inference_mode():
        for group, variants in _groups(args.tokens, dtype).items():
            for fn in variants.values():  # warm-up: first-call allocations and oneDNN/MKL primitive caches
                fn()
                fn()
            samples = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    samples[name].append(_time(fn))
            medians = {name: statistics.median(s) for name, s in samples.items()}
            base = next(iter(medians.values()))
            print(f"\n{group}")
            for name, t in medians.items():
                print(f"  {name:<52} {t * 1e3:8.2f} ms   x{base / t:5.2f} vs eager")


if __name__ == "__main__":
    main()
