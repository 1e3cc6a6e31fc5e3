"""`ttftc loadtest` run: what the parsed arguments of ttftc/commands/loadtest.py do."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

from ttftc.bench.report import plot_available
from ttftc.commands import UsageError
from ttftc.bench import loadtest_report as report
from ttftc.bench.loadtest import LoadSpec, run_load


def run(args) -> int:
    if args.plot:
        if not args.plot.lower().endswith(".png"):
            raise UsageError(f"--plot {args.plot!r}: the plot is a PNG, give a path ending in .png")
        missing = plot_available()
        if missing:
            raise UsageError(missing)
    for url in (args.url, args.compare):
        if url is not None and not url.startswith(("http://", "https://")):
            raise UsageError(f"URL {url!r} must start with http:// or https://")
    if args.compare and args.plot:
        raise UsageError("--plot draws one run; leave it out with --compare (or run each URL on its own)")
    try:
        spec = LoadSpec(url=args.url, rate=args.rate, duration_s=args.duration, prompt_len=args.prompt_len,
                        shared_prefix=args.shared_prefix, max_tokens=args.max_tokens, concurrency=args.concurrency,
                        slo_ttft_ms=args.slo_ttft_ms, long_prompt_len=args.long_prompt_len,
                        long_every_s=args.long_every, long_priority=args.long_priority, model=args.model,
                        headers=tuple(args.header), seed=args.seed, request_timeout_s=args.request_timeout)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    docs = []
    for url in (args.url,) + ((args.compare,) if args.compare else ()):
        try:
            docs.append(asyncio.run(run_load(dataclasses.replace(spec, url=url))))
        except Exception as exc:  # the server is down, or lists no such model
            raise UsageError(f"{url}: {type(exc).__name__}: {exc}") from None
        print("\n".join(report.summary_lines(docs[-1])))
    if len(docs) == 2:
        print("\n".join(report.comparison_lines(*docs)))
        combined = {"schema": "ttftc-loadtest-compare/1", "runs": docs}
        outputs = ((args.json, lambda _, path: report.write_json(combined, path)),
                   (args.md, lambda _, path: report.write_comparison_markdown(docs, path)))
    else:
        outputs = ((args.json, report.write_json), (args.md, report.write_markdown), (args.plot, report.write_plot))
    for path, write in outputs:
        if path:
            write(docs[0], path)
            print(f"wrote {path}", file=sys.stderr)
    # a server that answered (served or refused with 429) was measured; one that answered nothing was not
    return 0 if all(doc["summary"]["completed"] + doc["summary"]["rejected"] for doc in docs) else 1
