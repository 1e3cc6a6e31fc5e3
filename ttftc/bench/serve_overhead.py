"""What the HTTP layer adds to TTFT: one request at a time, `LLM.generate`'s TTFT against TTFT at the socket.

    python -m ttftc.bench.serve_overhead --model llama-135m --prompt-len 512 --repeats 10

In one process: an LLM, then the same LLM behind `ttftc serve`'s app on a free 127.0.0.1 port. Each repeat sends
a fresh random prompt (PRIVATE in-process, no tenant header at the socket: nothing is reused) first through
`LLM.generate` (TTFT from the call to the first token, as the scheduler records it) and then through the `openai`
client (TTFT from the request to the first streamed chunk, read at the client's socket). Prints both medians and
their ratio as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional, Sequence

import torch

from ttftc.llm import LLM
from ttftc.runtime.prefix_cache import PRIVATE
from ttftc.serve.app import create_app
from ttftc.bench.loadtest import openai_module
from ttftc.serve.server import BackgroundServer


def measure(llm: LLM, prompt_len: int, repeats: int, seed: int = 0) -> dict:
    vocab = llm.geometry.vocab_size
    generator = torch.Generator().manual_seed(seed)

    def fresh() -> list[int]:
        return torch.randint(0, vocab, (prompt_len,), generator=generator).tolist()

    in_process, at_socket = [], []
    with BackgroundServer(create_app(llm)) as server:
        client = openai_module().OpenAI(base_url=server.url + "/v1", api_key="overhead", max_retries=0, timeout=300)
        for r in range(repeats + 1):  # the first round warms both paths and is not counted
            (result,) = llm.generate([fresh()], max_new_tokens=1, tenant=PRIVATE)
            start = time.perf_counter()
            stream = client.completions.create(model=llm.name, prompt=fresh(), max_tokens=1, temperature=0,
                                               stream=True)
            first = None
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].model_extra.get("token_ids"):
                    first = time.perf_counter() - start
            if r:
                in_process.append(result.ttft_s)
                at_socket.append(first)
    generate_ms = statistics.median(in_process) * 1e3
    socket_ms = statistics.median(at_socket) * 1e3
    return {"prompt_len": prompt_len, "repeats": repeats, "generate_ttft_ms_p50": generate_ms,
            "socket_ttft_ms_p50": socket_ms, "ratio": socket_ms / generate_ms,
            "generate_ttft_ms": [round(x * 1e3, 2) for x in in_process],
            "socket_ttft_ms": [round(x * 1e3, 2) for x in at_socket]}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-135m")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--batch-window-ms", type=float, default=2.0)
    args = parser.parse_args(argv)
    llm = LLM(args.model, precision=args.precision, batch_window_ms=args.batch_window_ms)
    try:
        print(json.dumps(measure(llm, args.prompt_len, args.repeats)), flush=True)
    finally:
        llm.close()


if __name__ == "__main__":
    main()
