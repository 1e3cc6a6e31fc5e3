"""Issue 31's disk-tier bar: after a restart, a prompt whose long prefix the previous process cached, against cold.

Process 1 (an `LLM` with `kv_disk=DIR`) prefills `--shared` tokens for a tenant and closes, which writes its prefix
cache to DIR. Then, for each round, a new `LLM` on the same DIR (a restart) serves, first, a prompt of the same
length that shares nothing (cold) and then the cached prefix plus `--new` other tokens (its first request to touch
that prefix). Prints each TTFT, what the tier loaded or declined, and the ratio of the medians (restart hit / cold).

Run:  python benchmarks/kv_disk_restart.py [--model llama-135m] [--shared 1536] [--new 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

import ttftc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-135m")
    parser.add_argument("--shared", type=int, default=1536)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)

    def llm(directory: str) -> ttftc.LLM:
        # Eager prefill (no buckets, no compiled KV path): the arms differ only in what the cache serves.
        return ttftc.LLM(args.model, precision="fp32", buckets=None, compile_kv_path=False, kv_disk=directory)

    with tempfile.TemporaryDirectory(prefix="ttftc-kv-disk-") as directory:
        first = llm(directory)
        vocab = first.geometry.vocab_size

        def tokens(n: int) -> list[int]:
            return torch.randint(0, vocab, (n,), generator=generator).tolist()

        shared = tokens(args.shared)
        first.generate(shared, max_new_tokens=1, tenant="bench")
        first.close()
        cold, hit = [], []
        for round_ in range(args.rounds):
            restarted = llm(directory)
            [out] = restarted.generate(tokens(args.shared + args.new), max_new_tokens=1, tenant="bench")
            assert out.cached_tokens == 0
            cold.append(out.ttft_s)
            [out] = restarted.generate(shared + tokens(args.new), max_new_tokens=1, tenant="bench")
            hit.append(out.ttft_s)
            stats, tier = restarted._prefix_cache.stats(), restarted._prefix_cache.disk.stats()
            rate = tier.load_seconds_per_byte
            print(f"round {round_ + 1}: cold {cold[-1] * 1e3:.0f} ms; restart hit {hit[-1] * 1e3:.0f} ms with "
                  f"{out.cached_tokens} tokens cached ({stats.disk_loaded_blocks} blocks loaded, "
                  f"{stats.disk_declined_blocks} declined; measured load "
                  f"{'n/a' if rate is None else f'{1 / rate / 2**30:.2f} GiB/s'})")
            restarted.close(drain_timeout_s=0)  # writes this round's blocks too: the next restart finds them
        ratio = statistics.median(hit) / statistics.median(cold)
        print(f"median TTFT: cold {statistics.median(cold) * 1e3:.0f} ms, restart hit {statistics.median(hit) * 1e3:.0f}"
              f" ms: ratio {ratio:.3f} (bar: <= 0.5)")


if __name__ == "__main__":
    main()
