"""Which exact CPU path should ttftc.attention take? Interleaved medians in one process, reported as ratios.

Candidates, per case:
  native      ttftc's CPU lowering on its native fp32 kernel (csrc/attention_kernel.h: every mask in one pass)
  flash       the lowering on ATen's flash kernel (LSE merge for q_offset; query blocks for a window)
  gemm_blocks the lowering on batched GEMMs per block of query rows (plain causal; the rest is flash)
  flash+mask  the flash kernel with a full additive [Sq, Skv] mask (the obvious alternative for offset/window)
  blocked     a query-blocked matmul + softmax loop in plain torch (256 rows per block, GQA by broadcasting)
  reference   the op's own reference (what runs without a lowering)
q, k and v are [B, S, H, D] tensors viewed as [B, H, S, D], as a model's projections produce them.

Run:  python benchmarks/attention_cpu.py [--lengths 512 2048] [--repeats 5]
Only ratios against `flash` measured in the same round are meaningful on a shared machine.

Earlier findings (benchmarks/README.md, attention kernels): one masked call beat the rewrites for offset/window
cases up to 1M query-key pairs, so the flash path uses it there (the rewrites keep memory O(rows x window) beyond
that); the LSE merge beat one masked call for chunks at an offset.
"""


from __future__ import annotations

import argparse
import statistics
import time

import torch

from ttftc.codegen.cpu.attention import attention_cpu, kernels_for
from ttftc.ops.attention import attention, attention_mask

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def flash_with_mask(q, k, v, *, causal, scale, q_offset=0, window=0):
    visible = attention_mask(q.shape[2], k.shape[2], causal=causal, q_offset=q_offset, window=window, kv_len=None,
                             device=q.device)
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape[-2:], dtype=q.dtype).masked_fill_(~visible[0, 0], float("-inf"))
    return _flash(q, k, v, 0.0, False, attn_mask=mask, scale=scale)[0]


def blocked(q, k, v, *, causal, scale, q_offset=0, window=0, rows=256):
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, sq, d)
    kt = k.unsqueeze(2).transpose(-1, -2)
    vv = v.unsqueeze(2)
    out = torch.empty_like(qg)
    for start in range(0, sq, rows):
        stop = min(sq, start + rows)
        hi = min(skv, q_offset + stop) if causal else skv
        scores = torch.matmul(qg[:, :, :, start:stop], kt[..., :hi]) * scale
        visible = attention_mask(stop - start, hi, causal=causal, q_offset=q_offset, window=window, kv_len=None,
                                 device=q.device, row_start=start)
        if visible is not None:
            scores.masked_fill_(~visible[0, 0], float("-inf"))
        out[:, :, :, start:stop] = torch.matmul(torch.softmax(scores, -1), vv[..., :hi, :])
    return out.reshape(b, hq, sq, d)


def reference(q, k, v, **params):
    return attention.reference(q, k, v, **params)


def _lowering(kernel):
    return lambda q, k, v, **params: attention_cpu(q, k, v, tuning_config={"kernel": kernel}, **params)


CANDIDATES = {"native": _lowering("native"), "flash": _lowering("flash"), "gemm_blocks": _lowering("gemm_blocks"),
              "flash+mask": flash_with_mask, "blocked": blocked, "reference": reference}


def cases(lengths):
    for s in lengths:
        yield f"causal S={s} H=16/16", dict(hq=16, hkv=16, sq=s, skv=s), dict(causal=True)
        yield f"causal S={s} H=16/4 (GQA)", dict(hq=16, hkv=4, sq=s, skv=s), dict(causal=True)
        half = s // 2
        yield f"chunk S={half} after {half}", dict(hq=16, hkv=16, sq=half, skv=s), dict(causal=True, q_offset=half)
        yield f"window 256 S={s}", dict(hq=16, hkv=16, sq=s, skv=s), dict(causal=True, window=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--skip-reference", action="store_true")
    args = parser.parse_args()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    names = [n for n in CANDIDATES if not (args.skip_reference and n == "reference")
             and not (n == "native" and "native" not in kernels_for(dtype))]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, D=64, batch 1")
    print(f"{'case':<28}" + "".join(f"{n:>14}" for n in names) + "   (median ms; x = time / flash)")
    for label, shape, params in cases(args.lengths):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, shape["sq"], shape["hq"], 64, generator=gen).to(dtype).transpose(1, 2)
        k = torch.randn(1, shape["skv"], shape["hkv"], 64, generator=gen).to(dtype).transpose(1, 2)
        v = torch.randn(1, shape["skv"], shape["hkv"], 64, generator=gen).to(dtype).transpose(1, 2)
        params = dict(params, scale=0.125)
        expected = attention.reference(q.float(), k.float(), v.float(), **params)
        times = {n: [] for n in names}
        for n in names:  # warm-up, and every candidate must be exact
            out = CANDIDATES[n](q, k, v, **params)
            err = (out.float() - expected).abs().max().item()
            assert err < (1e-4 if dtype == torch.float32 else 3e-2), f"{n} is off by {err} on {label}"
        for _ in range(args.repeats):
            for n in names:  # interleaved: every round measures all candidates under the same load
                t0 = time.perf_counter()
                CANDIDATES[n](q, k, v, **params)
                times[n].append(time.perf_counter() - t0)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        cells = "".join(f"{med[n]:>8.1f} {med[n] / med['flash']:>4.2f}x" for n in names)
        print(f"{label:<28}{cells}")


if __name__ == "__main__":
    main()
