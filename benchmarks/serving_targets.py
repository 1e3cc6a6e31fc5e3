"""Issue 31's bars, measured at the socket: each `ttftc serve` started fresh, alone, and measured with the real client.

Scenarios (all on `--model`, llama-135m by default, fp32, the server's default flags plus those named):
- capacity:  `ttftc loadtest --rate inf` (128-token prompts, 16 tokens out), the rate the others are sized from.
- overload:  arrivals at 2x capacity with and without `--slo-ttft-ms 700`: goodput of each, and how fast a 429 came.
- priority:  the chunked-prefill mixed load (short requests plus a 4096-token prompt every 20 s), the long prompts
             at priority 10 against the same load at equal priorities: the short requests' p95 TTFT.
- estimate:  half capacity: the median absolute relative error of `x-ttftc-estimated-ttft-ms`.
- warm:      `--warm-prompts` with a 1536-token system prompt: the first request that shares it, against a cold
             prompt of the same length on a server without warm prompts.
- disk:      `--kv-disk DIR`: a 1536-token prefix cached, the server restarted, then that prefix plus new tokens,
             against a cold prompt of the same length on the restarted server.

Every server waits until its background compilation has ended (`ttftc_buckets_compiling` reads 0 and
`ttftc_kv_path_compiled` 1) before it is measured, so compiling never shares the CPU with a measurement.

Run:  python benchmarks/serving_targets.py [--only capacity,overload,...] [--capacity R] [--out DIR]
Writes each loadtest's JSON and each server's log under --out, and prints one summary line per bar.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import openai

SCENARIOS = ("capacity", "overload", "priority", "estimate", "warm", "disk")
COMPILING_GAUGE = "ttftc_buckets_compiling"
KV_PATH_GAUGE = "ttftc_kv_path_compiled"
SERVER_FLAGS: list[str] = []  # --server-flags, for every server


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except Exception:
        return 0, ""


def _gauge(metrics: str, name: str, absent: float) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return absent  # a server that does not report the gauge compiles nothing in the background


def _still_compiling(metrics: str, eager_kv_path: bool) -> bool:
    # The KV path compiles last, after every bucket's graphs (batched ones included); an eager one never does.
    kv_pending = not eager_kv_path and _gauge(metrics, KV_PATH_GAUGE, 1.0) < 1
    return _gauge(metrics, COMPILING_GAUGE, 0.0) > 0 or kv_pending


@contextmanager
def server(model: str, port: int, flags: list[str], log: Path, start_timeout_s: float = 1800):
    flags = [*SERVER_FLAGS, *flags]
    command = [sys.executable, "-m", "ttftc.cli", "serve", model, "--precision", "fp32", "--port", str(port), *flags]
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            while _get(url + "/health")[0] != 200:
                if process.poll() is not None or time.perf_counter() - started > start_timeout_s:
                    raise RuntimeError(f"server {' '.join(command)} did not start; see {log}")
                time.sleep(0.5)
            ready_s = time.perf_counter() - started
            while _still_compiling(_get(url + "/metrics")[1], "--eager-kv-path" in flags):
                if time.perf_counter() - started > start_timeout_s:
                    raise RuntimeError(f"buckets still compiling after {start_timeout_s} s; see {log}")
                time.sleep(2)
            print(f"  server :{port} {' '.join(flags) or '(defaults)'}: ready {ready_s:.1f} s, buckets compiled "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
            yield url
        finally:
            process.send_signal(signal.SIGINT)  # a graceful stop: the disk tier persists on shutdown
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def loadtest(url: str, out: Path, name: str, *args: str) -> dict:
    path = out / f"{name}.json"
    subprocess.run([sys.executable, "-m", "ttftc.cli", "loadtest", url, *args, "--json", str(path)], check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


TENANT = ["--tenant-header", "X-Tenant"]  # requests without a tenant share no cached prefix


def first_token_s(url: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from sending a streamed completion (as tenant "acme") to its first token, and the cached tokens it
    reported."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=600,
                           default_headers={"X-Tenant": "acme"})
    started = time.perf_counter()
    first = None
    cached = 0
    stream = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=2,
                                       temperature=0.0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and any(c.text or (c.model_extra or {}).get("token_ids") for c in chunk.choices):
            first = time.perf_counter() - started
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return first, cached


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-135m")
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--capacity", type=float, help="req/s, skipping the capacity scenario's measurement")
    parser.add_argument("--port", type=int, default=8310)
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="ttftc-serving-targets-")))
    parser.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this (llama-135m: 32000)")
    parser.add_argument("--server-flags", default="",
                        help="flags every server gets, e.g. --server-flags=--eager-kv-path (no KV-path compile at "
                        "each start); write it with '=' as the flags start with '--'")
    args = parser.parse_args()
    chosen = args.only.split(",")
    SERVER_FLAGS.extend(args.server_flags.split())
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(f"writing to {out}", flush=True)
    rng = random.Random(0)
    common = ["--prompt-len", "128", "--max-tokens", "16"]
    capacity = args.capacity
    lines = []

    if "capacity" in chosen and capacity is None:
        with server(args.model, args.port, [], out / "capacity.log") as url:
            doc = loadtest(url, out, "capacity", "--rate", "inf", "--duration", "40", "--concurrency", "4", *common)
        capacity = doc["summary"]["throughput_rps"]
        lines.append(f"capacity: {capacity:.2f} req/s (closed loop, 4 clients, 128-token prompts, 16 out)")
    if capacity is None and {"overload", "estimate"} & set(chosen):
        raise SystemExit("overload and estimate need the capacity: run it too, or give --capacity")

    if "overload" in chosen:
        rate = f"{2 * capacity:.2f}"
        docs = {}
        for name, flags in (("overload-slo", ["--slo-ttft-ms", "700"]), ("overload-plain", [])):
            with server(args.model, args.port, flags, out / f"{name}.log") as url:
                docs[name] = loadtest(url, out, name, "--rate", rate, "--duration", "40", "--concurrency", "256",
                                      "--slo-ttft-ms", "700", "--seed", "2", *common)
        slo, plain = docs["overload-slo"]["summary"], docs["overload-plain"]["summary"]
        ratio = slo["goodput_rps"] / plain["goodput_rps"] if plain["goodput_rps"] else float("inf")
        refused = slo["rejected_ms"]
        lines.append(f"overload at {rate} req/s: goodput {slo['goodput_rps']:.2f} with --slo-ttft-ms 700 against "
                     f"{plain['goodput_rps']:.2f} without: {ratio:.1f}x (bar >= 2x); {slo['rejected']} refused, "
                     f"429 latency p50 {refused.get('p50')} ms, max {refused.get('max')} ms (bar <= 50 ms)")

    if "priority" in chosen:
        # 0.91 req/s was 0.41 of the defaults' capacity where the chunked-prefill figures were measured.
        rate = f"{0.41 * capacity:.2f}" if capacity is not None else "0.91"
        mixed = ["--rate", rate, "--duration", "120", "--long-prompt-len", "4096", "--long-every", "20",
                 "--seed", "1", *common]
        p95 = {}
        for name, extra in (("priority-equal", []), ("priority-long-low", ["--long-priority", "10"])):
            with server(args.model, args.port, [], out / f"{name}.log") as url:
                doc = loadtest(url, out, name, *mixed, *extra)
            p95[name] = doc["summary"]["ttft_ms"]["p95"]
        ratio = p95["priority-long-low"] / p95["priority-equal"]
        lines.append(f"priority, mixed load at {rate} req/s: short p95 {p95['priority-long-low']:.0f} ms with the long prompts at "
                     f"priority 10 against {p95['priority-equal']:.0f} ms at equal priority: {ratio:.2f}x "
                     "(bar <= 0.6x)")

    if "estimate" in chosen:
        with server(args.model, args.port, [], out / "estimate.log") as url:
            doc = loadtest(url, out, "estimate", "--rate", f"{capacity / 2:.2f}", "--duration", "60", "--seed", "3",
                           *common)
        estimate = doc["summary"]["estimate"]
        lines.append(f"estimate at {capacity / 2:.2f} req/s: median absolute error {estimate['abs_rel_error_p50']:.0%}"
                     f" (p95 {estimate['abs_rel_error_p95']:.0%}, signed median {estimate['rel_error_p50']:+.0%},"
                     f" n={estimate['n']}; bar <= 25%)")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.vocab) for _ in range(n)]

    if "warm" in chosen:
        system = tokens(1536)
        warm_file = out / "warm-prompts.jsonl"
        warm_file.write_text(json.dumps({"prompt": system, "tenant": "acme"}) + "\n")
        with server(args.model, args.port, TENANT, out / "warm-cold.log") as url:
            cold = [first_token_s(url, tokens(1536 + 16))[0] for _ in range(3)]
        with server(args.model, args.port, [*TENANT, "--warm-prompts", str(warm_file)], out / "warm.log") as url:
            warm = [first_token_s(url, system + tokens(16)) for _ in range(3)]
        ratio = warm[0][0] / statistics.median(cold)
        lines.append(f"warm prompts: first request sharing the 1536-token system prompt {warm[0][0] * 1e3:.0f} ms "
                     f"({warm[0][1]} cached tokens; next two {warm[1][0] * 1e3:.0f}, {warm[2][0] * 1e3:.0f} ms) "
                     f"against cold median {statistics.median(cold) * 1e3:.0f} ms: {ratio:.2f}x (bar <= 0.35x)")

    if "disk" in chosen:
        prefix = tokens(1536)
        with tempfile.TemporaryDirectory(prefix="ttftc-kv-disk-") as directory:
            flags = [*TENANT, "--kv-disk", directory]
            with server(args.model, args.port, flags, out / "disk-1.log") as url:
                first_token_s(url, prefix + tokens(16))
            with server(args.model, args.port, flags, out / "disk-2.log") as url:
                cold = first_token_s(url, tokens(1536 + 16))[0]
                hit, cached = first_token_s(url, prefix + tokens(16))
        lines.append(f"disk tier after a restart: {hit * 1e3:.0f} ms ({cached} cached tokens) against cold "
                     f"{cold * 1e3:.0f} ms: {hit / cold:.2f}x (bar <= 0.5x)")

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    print(f"\n{args.model}, fp32, on {cpu} ({os.cpu_count()} CPUs):")
    for line in lines:
        print("- " + line)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
