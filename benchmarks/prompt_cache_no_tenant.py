"""Issue 32's bar: a prompt that shares its first tokens with the previous call, through PrefillEngine with no tenant.

Each round draws a fresh system prompt, prefills system + 512 new tokens cold, then another prompt with the same
system prompt and 512 other tokens: the second call reuses the system prompt from the engine's default namespace.
Prints every time and the ratio of the medians (warm / cold); only that ratio means much on a shared machine.

Run:  python benchmarks/prompt_cache_no_tenant.py [--model llama-135m] [--shared 1536] [--new 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ttftc.bench.models import load_model, resolve_model
from ttftc.runtime import PrefillEngine, PrefixCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-135m")
    parser.add_argument("--shared", type=int, default=1536)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = PrefillEngine(load_model(resolve_model(args.model)), prefix_cache=PrefixCache(budget_bytes=1 << 31))
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, engine.geometry.vocab_size, (n,), generator=generator).tolist()

    def timed(prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        first = engine.first_token(prompt)  # no tenant: the engine's own namespace
        seconds = time.perf_counter() - start
        first.kv.release()
        return seconds, first.cached_tokens

    with torch.inference_mode():
        timed(tokens(64))  # first-call costs belong to neither arm
        cold, warm = [], []
        for _ in range(args.rounds):
            system = tokens(args.shared)
            seconds, cached = timed(system + tokens(args.new))
            assert cached == 0, "a fresh system prompt cannot be cached"
            cold.append(seconds)
            seconds, cached = timed(system + tokens(args.new))
            warm.append(seconds)
            print(f"cold {cold[-1]:.3f} s, warm {seconds:.3f} s with {cached} cached tokens")
    print(f"warm / cold (medians over {args.rounds} rounds): {statistics.median(warm) / statistics.median(cold):.3f}")


if __name__ == "__main__":
    main()
