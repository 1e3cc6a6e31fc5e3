"""Attention throughput for the device check: the Triton kernel at its default config and at each config
`ttftc autotune` stored for attention, with torch's SDPA beside them, against the GPU's bf16 peak.

    python3 scripts/device_check_attention.py '{"heads": 32, "kv_heads": 8, "head_dim": 64, "seq": 8192,
                                                 "cache": "DIR", "out": "attention.json"}'

Causal prefill attention of one sequence in bf16 (fp32 on CPU, where the interpreter runs it and the figures
only prove the code path). FLOPs: 4 · heads · head_dim · seq(seq+1)/2 (Q·Kᵀ and P·V over the causal pairs), as
in ttftc/bench/roofline.py. Times are CUDA events (ttftc.bench.timing.DeviceClock), the best of several calls.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import torch

from ttftc.autotune.cache import AutotuneCache
from ttftc.bench.devices import device_for_name
from ttftc.bench.roofline import causal_pairs, measure_gemm_peak
from ttftc.bench.timing import time_call
from ttftc.codegen.triton.attention import AttentionConfig, default_config, launch

SPEC_KEYS = {"heads": int, "kv_heads": int, "head_dim": int, "seq": int, "cache": str, "out": str}


def _spec(text: str) -> dict[str, Any]:
    spec = json.loads(text)
    if not isinstance(spec, dict) or set(spec) != set(SPEC_KEYS):
        raise SystemExit(f"expected a JSON object with exactly the keys {sorted(SPEC_KEYS)}, got {text[:200]}")
    for key, kind in SPEC_KEYS.items():
        if not isinstance(spec[key], kind) or (kind is int and spec[key] < 1):
            raise SystemExit(f"{key} must be a positive {kind.__name__}, got {spec[key]!r}")
    if spec["heads"] % spec["kv_heads"]:
        raise SystemExit(f"heads {spec['heads']} is not a multiple of kv_heads {spec['kv_heads']}")
    return spec


def _best_seconds(fn: Callable[[], Any], device: str, calls: int) -> float:
    fn()  # compile, and the first-touch allocations
    return min(time_call(fn, device=device) for _ in range(calls))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    spec = _spec(argv[0])
    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    calls = 10 if on_gpu else 1
    h, hkv, d, t = spec["heads"], spec["kv_heads"], spec["head_dim"], spec["seq"]
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, h, t, d, generator=g, device=device).to(dtype)
    k = torch.randn(1, hkv, t, d, generator=g, device=device).to(dtype)
    v = torch.randn(1, hkv, t, d, generator=g, device=device).to(dtype)
    flops = 4 * h * d * causal_pairs(t)
    published = device_for_name(torch.cuda.get_device_name()) if on_gpu else None
    peak = published.peak_flops("bf16")[0] if published else None
    measured = measure_gemm_peak("bf16", device=device, size=8192 if on_gpu else 256, repeats=3)
    measured_flops = measured.gflops * 1e9 if measured.gflops else None

    configs: list[tuple[str, Any]] = [("default", default_config(d, dtype, device))]
    for entry in AutotuneCache(spec["cache"]).entries():
        if entry.key.op == "attention" and entry.key.provider == "triton":
            try:
                configs.append((f"tuned {entry.key.shapes}"[:120], AttentionConfig(**entry.config)))
            except TypeError as exc:
                print(f"ignored a stored attention config {entry.config}: {exc}", file=sys.stderr)
    rows = []
    scale = d ** -0.5
    for label, config in configs:
        fn = lambda c=config: launch(q, k, v, causal=True, scale=scale, config=c)  # noqa: E731
        rows.append({"kernel": "ttftc triton", "config": f"{label}: {config}", **_rate(fn, device, calls, flops,
                                                                                       peak, measured_flops)})
    k_rep, v_rep = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)  # noqa: E731
    rows.append({"kernel": "torch SDPA", "config": "K/V repeated to every head", **_rate(sdpa, device, calls, flops,
                                                                                           peak, measured_flops)})
    result = {"shape": f"1 x {h}/{hkv} heads x {t} tokens x head dim {d}, causal, {str(dtype)[6:]}",
              "device": torch.cuda.get_device_name() if on_gpu else "cpu (interpreter)", "flops": flops,
              "published_device": published.name if published else None,
              "published_peak_tflops": published.peak_tflops.get("bf16") if published else None,
              "measured_mm_tflops": measured_flops / 1e12 if measured_flops else None, "configs": rows}
    with open(spec["out"], "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


def _rate(fn, device: str, calls: int, flops: int, peak, measured) -> dict[str, Any]:
    try:
        seconds = _best_seconds(fn, device, calls)
    except Exception as exc:  # one config that does not run is a result, not the end of the step
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    tflops = flops / seconds / 1e12
    return {"ms": seconds * 1e3, "tflops": tflops, "of_published_peak": tflops * 1e12 / peak if peak else None,
            "of_measured_peak": tflops * 1e12 / measured if measured else None}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
