"""`ttftc loadtest URL`: Poisson arrivals of streamed completions through the `openai` client; TTFT p50/p95/p99,
inter-token latency, throughput and goodput under a TTFT SLO, as JSON, Markdown and a plot."""

from __future__ import annotations

import argparse
import math

from ttftc.commands.bench import _non_negative, _positive


def _rate(text: str) -> float:
    if text.strip().lower() in ("inf", "max"):
        return math.inf
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"--rate {text!r}: requests per second (> 0), or inf for a closed loop")
    return value


def seconds(text: str, *, allow_zero: bool = False) -> float:
    """A finite number of seconds (or milliseconds): positive, or >= 0 with allow_zero."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value >= 0 if allow_zero else value > 0) or value == math.inf:
        raise argparse.ArgumentTypeError(f"expected a {'non-negative' if allow_zero else 'positive'} number, "
                                         f"got {text!r}")
    return value


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--header {text!r}: expected NAME:VALUE, e.g. X-Tenant:acme")
    return name.strip(), value.strip()


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "loadtest",
        help="load an OpenAI-compatible server with Poisson arrivals and report TTFT percentiles and goodput",
        description="Send streamed completions to URL (e.g. http://127.0.0.1:8000) as a Poisson process through "
        "the openai client, and report TTFT p50/p95/p99 (from each request's scheduled arrival to its first "
        "token), inter-token latency, throughput and goodput under --slo-ttft-ms.",
    )
    p.add_argument("url", metavar="URL", help="the server's base URL, without /v1")
    p.add_argument("--rate", type=_rate, required=True, help="requests per second, or inf (closed loop: capacity)")
    p.add_argument("--duration", type=seconds, required=True, help="seconds of arrivals")
    p.add_argument("--prompt-len", type=_positive, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--shared-prefix", type=_non_negative, default=0,
                   help="leading prompt tokens every request shares (default 0)")
    p.add_argument("--max-tokens", type=_positive, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--concurrency", type=_positive, default=64,
                   help="requests in flight at most (closed loop: the number of clients; default 64)")
    p.add_argument("--long-prompt-len", type=_non_negative, default=0,
                   help="also send one prompt of this many tokens right after the first (default 0: none)")
    p.add_argument("--long-every", type=lambda text: seconds(text, allow_zero=True), default=0.0, metavar="S",
                   help="with --long-prompt-len: another long prompt every S seconds after the first, while arrivals "
                   "last (default 0: one per run), so the short requests' p95 rests on more than two or three of "
                   "them meeting one")
    p.add_argument("--long-priority", type=int, default=None, metavar="P",
                   help="with --long-prompt-len: send the long prompts with request priority P (lower runs sooner; "
                   "default: no priority field, so they run as the short ones do)")
    p.add_argument("--slo-ttft-ms", type=seconds, default=700.0, help="the TTFT SLO of goodput (default 700)")
    p.add_argument("--model", help="model name (default: the first the server lists)")
    p.add_argument("--header", type=_header, action="append", default=[], metavar="NAME:VALUE",
                   help="an HTTP header for every request, e.g. X-Tenant:acme (repeatable)")
    p.add_argument("--seed", type=_non_negative, default=0, help="seed of arrivals and prompts (default 0)")
    p.add_argument("--request-timeout", type=seconds, default=300.0, help="seconds per request (default 300)")
    p.add_argument("--compare", metavar="URL2",
                   help="then run the same load (same seed: the same arrivals and prompts) against URL2 and report "
                   "the two side by side, e.g. a server with --slo-ttft-ms against one without; --json then holds "
                   "both runs")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--md", metavar="PATH", help="write the report as Markdown")
    p.add_argument("--plot", metavar="PATH.png", help="write TTFT over time and the latency CDF as a PNG")
    p.set_defaults(run_module="ttftc.commands.loadtest_run")
