"""TTFT demo: eager vs ttftc on a small local Llama, then the explain table.

The model is built from a config with random weights, saved with save_pretrained and loaded back from that
local directory, as a user's own checkpoint would be. Nothing is downloaded.

    python3 examples/quickstart.py [--seq 256] [--repeats 5] [--precision auto,int8]

"auto" runs bf16 where this CPU computes it natively and fp32 elsewhere (the probe's answer is printed); "int8"
is W8A8 with the rest as "auto". The TTFT table lists only variants faster than eager on this machine: int8 is
skipped before it compiles where no int8 GEMM beats fp32 here (the measurement is printed), and a variant that
measured slower than eager is named with its figure and a suggestion instead of a speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import ttftc
from ttftc import zoo
from ttftc.capabilities import probe
from ttftc.codegen.cpu.int8_linear import int8_gemm_choice

# llama-135m's layer shape (design.md) with half its layers: big enough that GEMMs dominate, as in real prefill.
DEMO_MODEL = dict(vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096)


def first_token(model, ids: torch.Tensor) -> torch.Tensor:
    """What a server does before it can stream anything: prefill (keeping the KV cache for decoding), logits of
    the last position, argmax."""
    logits = model(ids, logits_to_keep=1, use_cache=True).logits
    return logits[:, -1].argmax(-1)


def ttft_ms(model, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    first_token(model, ids)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=384, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", default="auto,int8", help="ttftc precisions to compare, comma-separated")
    args = parser.parse_args()
    try:
        configs = {p: ttftc.Config(precision=p) for p in args.precision.split(",")}
    except ValueError as exc:
        parser.error(str(exc))

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as model_dir:
        zoo.build("llama", "sdpa", **DEMO_MODEL).save_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: Llama, {params:.0f}M parameters, random weights; prompt: {args.seq} tokens; "
          f"{torch.get_num_threads()} threads")
    print(f"device: {probe('cpu').describe()}")
    skipped = {}
    if "int8" in configs:
        int8 = int8_gemm_choice()
        print(int8.describe())
        if int8.gemm == "fp32":
            skipped["ttftc-int8"] = (f"no fast int8 GEMM on this CPU (the best measured {int8.int8_speedup:.2f}x "
                                     "fp32's speed); use precision='auto'")
            del configs["int8"]

    ids = zoo.example_ids(model, args.seq)
    variants = {"eager": model}
    with torch.inference_mode():
        first_token(model, ids)  # warm-up
        for precision, config in configs.items():
            compiled = ttftc.compile(model, config)
            start = time.perf_counter()
            first_token(compiled, ids)
            print(f"ttftc-{precision} first call (compile included): {time.perf_counter() - start:.1f} s")
            variants[f"ttftc-{precision}"] = compiled

        times = {name: [] for name in variants}
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every variant alike
            for name, fn in variants.items():
                times[name].append(ttft_ms(fn, ids))
        expected = first_token(model, ids)
        same = {name: torch.equal(first_token(fn, ids), expected) for name, fn in variants.items()}

    eager_ms = statistics.median(times["eager"])
    print(f"TTFT p50 over {args.repeats} interleaved runs (speed-up over eager fp32; same first token as eager):")
    for name, samples in times.items():
        p50 = statistics.median(samples)
        if name != "eager" and p50 >= eager_ms:
            skipped[name] = (f"measured {p50:.1f} ms here, {p50 / eager_ms:.2f}x eager's TTFT; try "
                             "precision='auto' or `ttftc bench` to see why")
            continue
        print(f"  {name:<12} {p50:8.1f} ms   {eager_ms / p50:5.2f}x   {same[name]}")
    for name, why in skipped.items():
        print(f"  {name:<12} skipped: {why}")
    print()
    if configs:
        first_precision, first_config = next(iter(configs.items()))
        print(f"explain, ttftc-{first_precision}:")
        print(ttftc.explain(model, ids, config=first_config))


if __name__ == "__main__":
    main()
