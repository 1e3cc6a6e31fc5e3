"""`ttftc serve` run: what the parsed arguments of ttftc/commands/serve.py do.

LLM, create_app and run_server are looked up on their modules at each call (tests replace them there)."""

from __future__ import annotations

import sys
import time

import torch

import ttftc.llm
import ttftc.serve
from ttftc.commands import UsageError
from ttftc.commands.serve import NO_BUCKETS
from ttftc.serve.policy import PriorityFileError, PriorityRange, ServingPolicy, read_priority_file
from ttftc.serve.timeouts import HTTPTimeouts
from ttftc.serve.warm import WarmPromptsError, read_warm_prompts
from ttftc.serving_config import ServingConfig


def run(args) -> int:
    names = [name for name, _ in args.tenant_priority]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UsageError(f"--tenant-priority names {repeated[0]!r} more than once; give each tenant one priority")
    ranges, default = {name: PriorityRange(*pair) for name, pair in args.tenant_priority}, None
    if args.priority_file:
        try:
            default, from_file = read_priority_file(args.priority_file)
        except PriorityFileError as exc:
            raise UsageError(f"--priority-file: {exc}") from None
        both = sorted(set(from_file) & set(ranges))
        if both:
            raise UsageError(f"tenant {both[0]!r} has a range in --priority-file and in --tenant-priority; give one")
        ranges.update(from_file)
    if args.kv_disk and args.no_prompt_cache:
        raise UsageError("--kv-disk extends the prefix cache; leave out --no-prompt-cache")
    if ranges and not args.tenant_header:
        raise UsageError("--tenant-priority and a priority file's tenants need --tenant-header NAME: without it no "
                         "request names a tenant")
    warm = []
    if args.warm_prompts:
        if not args.tenant_header:
            raise UsageError("--warm-prompts needs --tenant-header NAME: requests without a tenant share no cache, "
                             "so none could hit a warm prompt")
        if args.no_prompt_cache:
            raise UsageError("--warm-prompts needs the prefix cache; leave out --no-prompt-cache")
        try:
            warm = read_warm_prompts(args.warm_prompts)  # before the model loads: a bad file fails fast
        except WarmPromptsError as exc:
            raise UsageError(f"--warm-prompts: {exc}") from None
    try:
        policy = ServingPolicy(tenant_priorities=ranges, slo_ttft_ms=args.slo_ttft_ms, slo_margin=args.slo_margin,
                               shed_priority_above=args.shed_priority_above,
                               **({} if default is None else {"default_priorities": default}))
    except ValueError as exc:
        raise UsageError(f"--priority-file: {exc}" if args.priority_file else str(exc)) from None
    settings = _llm_kwargs(args)
    try:
        ServingConfig(**settings)  # every setting checked before a model loads or a fleet starts
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    replicas = getattr(args, "replicas", None)
    if replicas is not None:
        from ttftc.commands import serve_fleet  # lazy: Ray, an optional extra, only for --replicas
        return serve_fleet.run(args, settings,
                               dict(tenant_header=args.tenant_header, policy=policy, warm=warm,
                                    report_cached_tokens=not args.no_report_cached_tokens))
    if getattr(args, "ray_address", None) or getattr(args, "routing", None):
        raise UsageError("--ray-address and --routing say how a fleet runs: give --replicas N too")
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.compile_before_ready:
        print(f"ttftc serve: loading {args.model} and compiling its graphs before it reports ready (the compile "
              "cache makes the next start fast)", file=sys.stderr, flush=True)
    else:
        print(f"ttftc serve: loading {args.model} (it serves once loaded; the buckets compile in the background, "
              "each used as soon as it is ready, and the compile cache makes the next start's fast)",
              file=sys.stderr, flush=True)
    try:
        llm = ttftc.llm.LLM(args.model, **settings,
                            on_progress=lambda line: print(f"ttftc serve: {line}", file=sys.stderr, flush=True))
    except (ValueError, TypeError, OSError) as exc:
        raise UsageError(str(exc)) from None
    for note in llm.notes:
        print(f"ttftc serve: {note}", file=sys.stderr)
    try:
        app = ttftc.serve.create_app(llm, tenant_header=args.tenant_header,
                                     report_cached_tokens=not args.no_report_cached_tokens, policy=policy, warm=warm)
    except ValueError as exc:  # WarmPromptsError among them: the warm prompts do not fit, or one failed
        llm.close(drain_timeout_s=0)
        raise UsageError(f"--warm-prompts: {exc}" if warm else str(exc)) from None
    if warm:
        warmed = app.state.served.warmed
        print(f"ttftc serve: {len(warmed.pins)} warm prompts pinned ({warmed.tokens} tokens)", file=sys.stderr)
    print(f"ttftc serve: {llm.name} ready in {time.perf_counter() - started:.1f} s on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    cut_off = ttftc.serve.run_server(app, host=args.host, port=args.port, drain_timeout_s=args.drain_timeout,
                                     log_level=args.log_level,
                                     timeouts=HTTPTimeouts(args.request_timeout, args.keep_alive_timeout))
    print(f"ttftc serve: stopped ({cut_off} requests cut off by the drain timeout)", file=sys.stderr)
    return 0


def _llm_kwargs(args) -> dict:
    """The ServingConfig's fields from the command line, as `ttftc.LLM`'s keyword arguments (its convenience form, so
    tests that stand in for LLM see each setting): one server's, or each replica's."""
    return dict(precision=args.precision, buckets=None if args.buckets == NO_BUCKETS else args.buckets,
                chunked_prefill=args.chunked_prefill, yield_chunk=args.yield_chunk,
                prompt_cache=not args.no_prompt_cache, prefix_cache_bytes=args.prefix_cache_mb << 20,
                artifact=args.artifact, max_batch_tokens=args.max_batch_tokens,
                batch_window_ms=args.batch_window_ms, max_running=args.max_running, name=args.name,
                compile_kv_path=not args.eager_kv_path, batched_decode=not args.no_batched_decode,
                kv_disk=args.kv_disk, kv_disk_bytes=args.kv_disk_mb << 20,
                background_compile=not args.compile_before_ready)
