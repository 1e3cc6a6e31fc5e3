"""`ttftc serve MODEL_OR_ARTIFACT`: an OpenAI-compatible streaming server (ttftc/serve/) on a `ttftc.LLM`."""

from __future__ import annotations

import argparse

from ttftc.commands.bench import _positive
from ttftc.commands.compile import _int_list
from ttftc.commands.loadtest import seconds


NO_BUCKETS = "none"
DEFAULT_BUCKETS_TEXT = "32,64,128,256,512,1024,2048"  # ttftc.llm.SERVING_BUCKETS, not imported: --help stays quick
DEFAULT_STEP_TOKENS = 512  # ttftc.llm.DEFAULT_STEP_TOKENS
DEFAULT_CHUNK_TOKENS = 128  # ttftc.llm.DEFAULT_CHUNK_TOKENS
DEFAULT_REQUEST_TIMEOUT_S = 30.0  # ttftc.serve.timeouts.HTTPTimeouts.request_s
DEFAULT_KEEP_ALIVE_S = 5.0  # ttftc.serve.timeouts.HTTPTimeouts.keep_alive_s


def _buckets(text: str):
    if text.strip().lower() == NO_BUCKETS:
        return NO_BUCKETS
    return _int_list(text)


def _chunk(text: str):
    if text.strip().lower() in ("none", "0", "off"):
        return None
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"--chunked-prefill {text!r}: a positive number of tokens, or none")
    return int(text)


def _non_negative_seconds(text: str) -> float:
    return seconds(text, allow_zero=True)


def _tenant_priority(text: str) -> tuple[str, tuple[int, int]]:
    """NAME=BEST..WORST, or NAME=BEST (to the largest priority): the priorities the tenant's requests may ask for."""
    name, sep, value = text.rpartition("=")
    best, dots, worst = value.partition("..")
    try:
        numbers = (int(best.strip()), int(worst.strip()) if dots else (1 << 31) - 1)
    except ValueError:
        numbers = None
    if (not sep or not name.strip() or numbers is None or not all(-(1 << 31) <= n < (1 << 31) for n in numbers)
            or numbers[0] > numbers[1]):
        raise argparse.ArgumentTypeError(f"--tenant-priority {text[:80]!r}: expected NAME=BEST..WORST or NAME=BEST "
                                         "with 32-bit integers, BEST <= WORST (lower runs sooner), e.g. batch=5..9")
    return name.strip(), numbers


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"--slo-margin {text!r}: a fraction in [0, 1), e.g. 0.2")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over HTTP with OpenAI's completions and chat API (streaming, metrics)",
        description="Serve MODEL_OR_ARTIFACT (a preset such as tiny or llama-135m, a local Hugging Face model "
        "directory, or an artifact directory from `ttftc compile`) at /v1/completions, /v1/chat/completions, "
        "/v1/models, /health and /metrics. Ctrl-C or SIGTERM drains the requests in flight, then exits.",
    )
    p.add_argument("model", metavar="MODEL_OR_ARTIFACT", help="preset name, model directory or artifact directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_positive, default=8000, help="port (default 8000)")
    p.add_argument("--name", help="the model name clients send (default: the preset or directory name)")
    p.add_argument("--artifact", metavar="DIR", help="serve prefill from this artifact; MODEL provides the decode")
    p.add_argument("--precision", default="auto", help="precision of the compiled prefill (default auto)")
    p.add_argument("--buckets", type=_buckets, default=DEFAULT_BUCKETS_TEXT, metavar="N[,N...]|none",
                   help=f"prompt-length buckets to compile (default {DEFAULT_BUCKETS_TEXT}); none serves every "
                   "prompt eagerly")
    p.add_argument("--chunked-prefill", type=_chunk, default=DEFAULT_CHUNK_TOKENS, metavar="N|none",
                   help=f"most tokens of one prompt a step prefills: long prompts run in chunks beside other "
                   f"requests (default {DEFAULT_CHUNK_TOKENS}); none prefills each prompt whole")
    p.add_argument("--yield-chunk", type=_positive, default=None, metavar="N",
                   help="most tokens per step of a prompt while a request of better priority is in flight "
                   "(default 32): smaller keeps the step a high-priority request waits for shorter, at the cost of "
                   "the low-priority prompt's throughput")
    p.add_argument("--no-prompt-cache", action="store_true", help="no prefix cache")
    p.add_argument("--eager-kv-path", action="store_true",
                   help="run decode and cached-prefix prefill eagerly instead of compiling them (starts faster)")
    p.add_argument("--compile-before-ready", action="store_true",
                   help="compile every bucket and the KV path before /health reports ready (default: serve once the "
                   "model is loaded, on the eager KV path, while they compile in the background)")
    p.add_argument("--prefix-cache-mb", type=_positive, default=1024, help="prefix cache budget (default 1024)")
    p.add_argument("--kv-disk", metavar="DIR",
                   help="a disk tier for the prefix cache: blocks evicted from RAM, and all of them at shutdown, are "
                   "kept in DIR (safetensors, checksummed; every file is checked before use), so a restart finds "
                   "them; a hit is loaded where loading measures faster than recomputing. `ttftc cache list|clear "
                   "DIR` shows or empties it")
    p.add_argument("--kv-disk-mb", type=_positive, default=8192, help="the disk tier's budget in MiB for the whole --kv-disk directory, "
                   "which every process and replica on it shares: give each the same budget (default 8192)")
    p.add_argument("--max-batch-tokens", type=_positive, default=DEFAULT_STEP_TOKENS,
                   help="scheduler token budget per step (decodes plus prefill tokens; default "
                   f"{DEFAULT_STEP_TOKENS}). It bounds a step's time and so the wait of a short request behind a "
                   "long prompt: smaller favours short requests' TTFT and streams, larger the long prompt's TTFT "
                   "and throughput; also closes the batching window")
    p.add_argument("--batch-window-ms", type=_non_negative_seconds, default=2.0,
                   help="how long a new request may wait for others to share its prefill (default 2 ms; "
                   "0: none). It trades TTFT (each request may wait up to it) for throughput (fewer, larger "
                   "prefill forwards)")
    p.add_argument("--no-batched-decode", action="store_true",
                   help="decode each running request in its own forward instead of all in one per step")
    p.add_argument("--max-running", type=_positive, default=64, help="sequences in flight at once (default 64)")
    p.add_argument("--tenant-header", metavar="NAME",
                   help="HTTP header naming the tenant (prefix-cache namespace), e.g. X-Tenant; without it every "
                   "request is its own tenant and no cached prefix is shared. A trusted proxy in front of the "
                   "server must set this header (or strip it): whoever can set it can confirm guesses of that "
                   "tenant's cached prompt prefixes through usage.prompt_tokens_details.cached_tokens (and, more "
                   "noisily, TTFT)")
    p.add_argument("--tenant-priority", type=_tenant_priority, action="append", default=[],
                   metavar="NAME=BEST..WORST",
                   help="the priorities tenant NAME's requests may ask for (repeatable; needs --tenant-header; lower "
                   "runs sooner); NAME=BEST alone means BEST..2147483647. A request that names none runs at BEST; "
                   "one outside the range gets a 400. Requests without a listed tenant may ask for 0 or later")
    p.add_argument("--priority-file", metavar="FILE",
                   help='JSON {"default": [BEST, WORST], "tenants": {NAME: [BEST, WORST] or BEST}}: the same ranges '
                   "as --tenant-priority, plus the range of requests without a listed tenant (default 0..2147483647; "
                   "its BEST may not be below 0)")
    p.add_argument("--slo-ttft-ms", type=seconds, metavar="MS",
                   help="admission control (off by default): answer 429 at once, with Retry-After, to a request "
                   "whose estimated TTFT exceeds MS by more than --slo-margin")
    p.add_argument("--slo-margin", type=_margin, default=0.2, metavar="F",
                   help="with --slo-ttft-ms: refuse a request above MS x (1 + F), or above MS x (1 - F) when its "
                   "priority is above --shed-priority-above (default 0.2)")
    p.add_argument("--shed-priority-above", type=_int, default=0, metavar="P",
                   help="with --slo-ttft-ms: requests of a priority above P (less important) are shed first "
                   "(default 0)")
    p.add_argument("--warm-prompts", metavar="FILE",
                   help='JSON lines {"prompt": text or [token ids], "tenant": name}: each is prefilled into the prefix '
                   "cache and pinned there (never evicted; counted against --prefix-cache-mb) before the server "
                   "reports ready, so the first request of that tenant starting with it is served from the cache "
                   "(needs --tenant-header)")
    p.add_argument("--no-report-cached-tokens", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens as 0 (the prefix cache still works), so "
                   "the field tells a client nothing about other requests' prompts")
    p.add_argument("--drain-timeout", type=_non_negative_seconds, default=30.0,
                   help="seconds requests in flight may finish after Ctrl-C or SIGTERM (default 30)")
    p.add_argument("--request-timeout", type=seconds, default=DEFAULT_REQUEST_TIMEOUT_S, metavar="S",
                   help="seconds a client has to send a whole request (line, headers, body) from its connection's "
                   "opening or the request's first byte; slower ones are closed, so connections that never finish a "
                   f"request (slowloris) cannot pile up (default {DEFAULT_REQUEST_TIMEOUT_S:g})")
    p.add_argument("--keep-alive-timeout", type=seconds, default=DEFAULT_KEEP_ALIVE_S, metavar="S",
                   help=f"seconds a connection may stay idle between requests (default {DEFAULT_KEEP_ALIVE_S:g})")
    p.add_argument("--threads", type=_positive, help="torch intra-op threads (default: one per core; with "
                   "--replicas, per replica: the cores divided among the replicas)")
    p.add_argument("--replicas", type=_positive, metavar="N",
                   help="serve N replicas of the model (each its own process, engine and prefix cache) behind this "
                   "one endpoint, on Ray Serve (pip install 'ttftc[fleet]'); a local Ray cluster starts unless "
                   "--ray-address names one. Without it, one process serves, and Ray is not used")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="with --replicas: join this running Ray cluster (e.g. 10.0.0.5:6379, or auto), so the "
                   "replicas can span its machines")
    p.add_argument("--routing", choices=("prefix", "balanced"),
                   help="with --replicas: prefix (default) sends a request to the replica most likely to hold its "
                   "tenant's prompt prefix in cache, unless that replica is much busier than the least loaded; "
                   "balanced sends each to the least-loaded replica")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(run_module="ttftc.commands.serve_run")
