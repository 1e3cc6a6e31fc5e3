"""TTFT demo: eager vs ttftc on a small local Llama, then the explain table.

The model is built from a config with random weights, saved with save_pretrained and loaded back from that
local directory, as a user's own checkpoint would be. Nothing is downloaded.

    python3 examples/quickstart.py [--seq 256] [--repeats 5] [--precision fp32|bf16|int8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import ttftc
from ttftc import zoo

DEMO_MODEL = dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)


def first_token(model, ids: torch.Tensor) -> torch.Tensor:
    """What a server does before it can stream anything: prefill, logits of the last position, argmax."""
    logits = model(ids, logits_to_keep=1, use_cache=False).logits
    return logits[:, -1].argmax(-1)


def ttft_ms(model, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    first_token(model, ids)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=256, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "int8"))
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as model_dir:
        zoo.build("llama", "sdpa", **DEMO_MODEL).save_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: Llama, {params:.0f}M parameters, random weights; prompt: {args.seq} tokens; "
          f"{torch.get_num_threads()} threads")

    ids = zoo.example_ids(model, args.seq)
    config = ttftc.Config(precision=args.precision)
    compiled = ttftc.compile(model, config)
    with torch.inference_mode():
        start = time.perf_counter()
        first_token(compiled, ids)
        print(f"ttftc first call (compile included): {time.perf_counter() - start:.1f} s")
        first_token(model, ids)  # warm-up

        eager, fused = [], []
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
            eager.append(ttft_ms(model, ids))
            fused.append(ttft_ms(compiled, ids))
        same = torch.equal(first_token(model, ids), first_token(compiled, ids))

    e, f = statistics.median(eager), statistics.median(fused)
    print(f"TTFT p50 over {args.repeats} runs: eager {e:.1f} ms | ttftc-{args.precision} {f:.1f} ms "
          f"| ratio {f / e:.2f}x | same first token: {same}")
    print()
    print(ttftc.explain(model, ids, config=config))


if __name__ == "__main__":
    main()
