"""`ttftc serve MODEL_OR_ARTIFACT`: an OpenAI-compatible streaming server (ttftc/serve/) on a `ttftc.LLM`."""

from __future__ import annotations

import argparse

from ttftc.commands.bench import _positive
from ttftc.commands.loadtest import seconds


NO_BUCKETS = "none"
DEFAULT_BUCKETS_TEXT = "32,64,128,256,512,1024,2048"  # ttftc.llm.SERVING_BUCKETS, not imported: --help stays quick
DEFAULT_STEP_TOKENS = 512  # ttftc.llm.DEFAULT_STEP_TOKENS
DEFAULT_CHUNK_TOKENS = 128  # ttftc.llm.DEFAULT_CHUNK_TOKENS


def _buckets(text: str):
    if text.strip().lower() == NO_BUCKETS:
        return NO_BUCKETS
    from ttftc.commands.compile import _int_list

    return _int_list(text)


def _chunk(text: str):
    if text.strip().lower() in ("none", "0", "off"):
        return None
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"--chunked-prefill {text!r}: a positive number of tokens, or none")
    return int(text)


def _non_negative_seconds(text: str) -> float:
    return seconds(text, allow_zero=True)


def _tenant_priority(text: str) -> tuple[str, int]:
    name, sep, value = text.rpartition("=")
    try:
        number = int(value.strip())
    except ValueError:
        number = None
    if not sep or not name.strip() or number is None or not -(1 << 31) <= number < (1 << 31):
        raise argparse.ArgumentTypeError(f"--tenant-priority {text!r}: expected NAME=INT with INT a 32-bit integer "
                                         "(lower runs sooner), e.g. batch=5")
    return name.strip(), number


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
    p.add_argument("--no-prompt-cache", action="store_true", help="no prefix cache")
    p.add_argument("--eager-kv-path", action="store_true",
                   help="run decode and cached-prefix prefill eagerly instead of compiling them (starts faster)")
    p.add_argument("--prefix-cache-mb", type=_positive, default=1024, help="prefix cache budget (default 1024)")
    p.add_argument("--kv-disk", metavar="DIR",
                   help="a disk tier for the prefix cache: blocks evicted from RAM, and all of them at shutdown, are "
                   "kept in DIR (safetensors, checksummed; every file is checked before use), so a restart finds "
                   "them; a hit is loaded where loading measures faster than recomputing. `ttftc cache list|clear "
                   "DIR` shows or empties it")
    p.add_argument("--kv-disk-mb", type=_positive, default=8192, help="the disk tier's budget (default 8192)")
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
    p.add_argument("--tenant-priority", type=_tenant_priority, action="append", default=[], metavar="NAME=INT",
                   help="the priority of tenant NAME's requests (repeatable; needs --tenant-header; lower runs "
                   "sooner). A request's own priority field may ask to run later than this, never sooner")
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
    p.add_argument("--threads", type=_positive, help="torch intra-op threads (default: one per core)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(run=run)


def run(args) -> int:
    import sys
    import time

    import torch

    from ttftc.commands import UsageError
    from ttftc.llm import LLM
    from ttftc.serve import create_app, run_server
    from ttftc.serve.policy import ServingPolicy

    names = [name for name, _ in args.tenant_priority]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UsageError(f"--tenant-priority names {repeated[0]!r} more than once; give each tenant one priority")
    if args.kv_disk and args.no_prompt_cache:
        raise UsageError("--kv-disk extends the prefix cache; leave out --no-prompt-cache")
    if names and not args.tenant_header:
        raise UsageError("--tenant-priority needs --tenant-header NAME: without it no request names a tenant")
    warm = []
    if args.warm_prompts:
        from ttftc.serve.warm import WarmPromptsError, read_warm_prompts

        if not args.tenant_header:
            raise UsageError("--warm-prompts needs --tenant-header NAME: requests without a tenant share no cache, "
                             "so none could hit a warm prompt")
        if args.no_prompt_cache:
            raise UsageError("--warm-prompts needs the prefix cache; leave out --no-prompt-cache")
        try:
            warm = read_warm_prompts(args.warm_prompts)  # before the model loads: a bad file fails fast
        except WarmPromptsError as exc:
            raise UsageError(f"--warm-prompts: {exc}") from None
    policy = ServingPolicy(tenant_priorities=dict(args.tenant_priority), slo_ttft_ms=args.slo_ttft_ms,
                           slo_margin=args.slo_margin, shed_priority_above=args.shed_priority_above)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    print(f"ttftc serve: loading {args.model} (compiling buckets on first start; the compile cache makes the next "
          "start fast)", file=sys.stderr, flush=True)
    try:
        llm = LLM(args.model, precision=args.precision, buckets=None if args.buckets == NO_BUCKETS else args.buckets,
                  chunked_prefill=args.chunked_prefill,
                  prompt_cache=not args.no_prompt_cache, prefix_cache_bytes=args.prefix_cache_mb << 20,
                  artifact=args.artifact, max_batch_tokens=args.max_batch_tokens,
                  batch_window_ms=args.batch_window_ms, max_running=args.max_running, name=args.name,
                  compile_kv_path=not args.eager_kv_path, batched_decode=not args.no_batched_decode,
                  kv_disk=args.kv_disk, kv_disk_bytes=args.kv_disk_mb << 20)
    except (ValueError, TypeError, OSError) as exc:
        raise UsageError(str(exc)) from None
    for note in llm.notes:
        print(f"ttftc serve: {note}", file=sys.stderr)
    try:
        app = create_app(llm, tenant_header=args.tenant_header, report_cached_tokens=not args.no_report_cached_tokens,
                         policy=policy, warm=warm)
    except ValueError as exc:  # WarmPromptsError among them: the warm prompts do not fit, or one failed
        llm.close(drain_timeout_s=0)
        raise UsageError(f"--warm-prompts: {exc}" if warm else str(exc)) from None
    if warm:
        warmed = app.state.served.warmed
        print(f"ttftc serve: {len(warmed.pins)} warm prompts pinned ({warmed.tokens} tokens)", file=sys.stderr)
    print(f"ttftc serve: {llm.name} ready in {time.perf_counter() - started:.1f} s on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    cut_off = run_server(app, host=args.host, port=args.port, drain_timeout_s=args.drain_timeout,
                         log_level=args.log_level)
    print(f"ttftc serve: stopped ({cut_off} requests cut off by the drain timeout)", file=sys.stderr)
    return 0
