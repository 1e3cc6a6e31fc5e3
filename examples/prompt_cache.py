"""Prompt caching: a system prompt prefilled once, then reused by every later call, with no tenant argument.

    python3 examples/prompt_cache.py [--system 1024] [--question 32] [--calls 4]

`ttftc.LLM` keeps a prefix cache. Calls that name no tenant share the LLM's own namespace, so the second call
that starts with the same system prompt prefills only its question. Each call is timed twice: once as PRIVATE
(a namespace of its own: nothing reused, the cold TTFT) and once as a normal call. A server puts requests from
different users in different namespaces instead (`ttftc serve --tenant-header`).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import ttftc
from ttftc import zoo
from ttftc.runtime import PRIVATE

# llama-135m's layer shape (design.md) with half its layers, as in examples/quickstart.py.
DEMO_MODEL = dict(vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", type=int, default=1024, help="system-prompt length in tokens")
    parser.add_argument("--question", type=int, default=32, help="tokens each call adds after the system prompt")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--layers", type=int, default=DEMO_MODEL["num_hidden_layers"])
    parser.add_argument("--eager", action="store_true", help="do not compile the KV path (starts faster)")
    args = parser.parse_args()
    if min(args.system, args.question, args.calls, args.layers) < 1:
        parser.error("--system, --question, --calls and --layers must be positive")

    model = zoo.build("llama", "sdpa", **{**DEMO_MODEL, "num_hidden_layers": args.layers})
    vocab = DEMO_MODEL["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    system = torch.randint(0, vocab, (args.system,), generator=generator).tolist()
    questions = [torch.randint(0, vocab, (args.question,), generator=generator).tolist() for _ in range(args.calls)]

    # buckets=None: every prompt runs on the KV path, the one that continues from cached KV.
    llm = ttftc.LLM(model, buckets=None, compile_kv_path=not args.eager)
    try:
        print(f"system prompt {args.system} tokens, question {args.question} tokens, {torch.get_num_threads()} "
              f"threads; block size {llm.stats()['prefix_cache'].block_size}")
        print(f"{'call':>4}  {'cold TTFT':>10}  {'TTFT':>10}  {'cached tokens':>13}")
        cold, warm = [], []
        for n, question in enumerate(questions, 1):
            prompt = system + question
            [private] = llm.generate([prompt], max_new_tokens=1, tenant=PRIVATE)
            [shared] = llm.generate([prompt], max_new_tokens=1)  # no tenant: the LLM's own namespace
            assert shared.token_ids == private.token_ids, "a cached prefix must give the same first token"
            cold.append(private.ttft_s)
            if n > 1:  # the first call fills the cache
                warm.append(shared.ttft_s)
            print(f"{n:>4}  {private.ttft_s * 1e3:>8.1f}ms  {shared.ttft_s * 1e3:>8.1f}ms  {shared.cached_tokens:>13}")
        if warm:
            ratio = statistics.median(warm) / statistics.median(cold)
            print(f"TTFT with the system prompt cached: {ratio:.2f}x the cold TTFT (medians, calls 2..{args.calls})")
    finally:
        llm.close()


if __name__ == "__main__":
    main()
