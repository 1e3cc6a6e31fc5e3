"""The loadtest's outputs: terminal lines, the JSON document, a Markdown report, and a plot of TTFT over the run
next to the latency CDFs."""

from __future__ import annotations

import json
from pathlib import Path

from ttftc.bench.report import pyplot, save_figure, write_atomically


def write_json(doc: dict, path: str) -> None:
    """The document as is, indented, in key order as built."""
    write_atomically(path, (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode())


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _rate(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary_lines(doc: dict) -> list[str]:
    s, cfg = doc["summary"], doc["settings"]
    t, i = s["ttft_ms"], s["itl_ms"]
    attained = "-" if s["slo_attainment"] is None else f"{s['slo_attainment']:.0%}"
    lines = [
        f"model {doc['model']}: rate {cfg['rate']}/s for {cfg['duration_s']} s, prompts {cfg['prompt_len']} tokens "
        f"({cfg['shared_prefix']} shared), {cfg['max_tokens']} generated, concurrency {cfg['concurrency']}",
        f"requests {s['requests']}, completed {s['completed']}, errors {s['errors']}, rejected (429) "
        f"{s.get('rejected', 0)}" + _rejected_text(s),
        f"TTFT ms      p50 {_ms(t['p50'])}  p95 {_ms(t['p95'])}  p99 {_ms(t['p99'])}  mean {_ms(t['mean'])}",
        f"ITL ms       p50 {_ms(i['p50'])}  p95 {_ms(i['p95'])}  p99 {_ms(i['p99'])}",
        f"throughput   {_rate(s['throughput_rps'])} req/s, {_rate(s['output_tokens_per_s'])} tokens/s",
        f"goodput      {_rate(s['goodput_rps'])} req/s within TTFT <= {cfg['slo_ttft_ms']:.0f} ms "
        f"({attained} of requests)",
    ]
    estimate = s.get("estimate") or {}
    if estimate.get("n"):
        lines.append(f"estimate     TTFT estimated by the server: |relative error| p50 "
                     f"{estimate['abs_rel_error_p50']:.0%}, p95 {estimate['abs_rel_error_p95']:.0%} "
                     f"(signed p50 {estimate['rel_error_p50']:+.0%}, {estimate['n']} requests)")
    for long in doc["long"]:
        lines.append(f"long prompt  {long['prompt_tokens']} tokens: TTFT {_ms(long['ttft_ms'])} ms"
                     + (f" ({long['error']})" if long["error"] else ""))
    for error in doc["first_errors"]:
        lines.append(f"error: {error}")
    return lines


def _rejected_text(s: dict) -> str:
    rejected = s.get("rejected_ms") or {}
    if not rejected.get("n"):
        return ""
    retry = s.get("retry_after_s_mean")
    return (f" answered in p50 {_ms(rejected['p50'])} / p95 {_ms(rejected['p95'])} ms"
            + ("" if retry is None else f", Retry-After {retry:.1f} s on average"))


_COMPARED = (
    ("requests", lambda s: str(s["requests"])),
    ("completed", lambda s: str(s["completed"])),
    ("rejected (429)", lambda s: str(s.get("rejected", 0))),
    ("errors", lambda s: str(s["errors"])),
    ("goodput req/s", lambda s: _rate(s["goodput_rps"])),
    ("SLO attainment", lambda s: "-" if s["slo_attainment"] is None else f"{s['slo_attainment']:.0%}"),
    ("TTFT p50 ms", lambda s: _ms(s["ttft_ms"]["p50"])),
    ("TTFT p95 ms", lambda s: _ms(s["ttft_ms"]["p95"])),
    ("429 latency p50 ms", lambda s: _ms((s.get("rejected_ms") or {}).get("p50"))),
    ("estimate |rel err| p50", lambda s: "-" if not (s.get("estimate") or {}).get("n")
     else f"{s['estimate']['abs_rel_error_p50']:.0%}"),
)


def comparison_lines(first: dict, second: dict) -> list[str]:
    """The same load against two servers, side by side (a Markdown table)."""
    a, b = first["settings"]["url"], second["settings"]["url"]
    lines = [f"| same load | {a} | {b} |", "| --- | --- | --- |"]
    for name, value in _COMPARED:
        lines.append(f"| {name} | {value(first['summary'])} | {value(second['summary'])} |")
    return lines


def _long_text(cfg: dict) -> str:
    if not cfg["long_prompt_len"]:
        return ""
    every = cfg.get("long_every_s") or 0
    return (f", {cfg['long_prompt_len']}-token prompts every {every:g} s" if every
            else f", one {cfg['long_prompt_len']}-token prompt")


def markdown(doc: dict) -> str:
    s, cfg = doc["summary"], doc["settings"]
    rows = [("TTFT", s["ttft_ms"]), ("inter-token latency", s["itl_ms"]), ("end to end", s["e2e_ms"])]
    out = [
        f"# ttftc loadtest: {doc['model']}",
        "",
        f"- target {cfg['url']}, created {doc['created']}",
        f"- Poisson rate {cfg['rate']}/s for {cfg['duration_s']} s (inf: closed loop), "
        f"concurrency {cfg['concurrency']}",
        f"- prompts of {cfg['prompt_len']} tokens ({cfg['shared_prefix']} shared), {cfg['max_tokens']} tokens "
        f"generated each" + _long_text(cfg),
        f"- requests {s['requests']}, completed {s['completed']}, errors {s['errors']}, rejected (429) "
        f"{s.get('rejected', 0)}" + _rejected_text(s),
        f"- throughput {_rate(s['throughput_rps'])} req/s, {_rate(s['output_tokens_per_s'])} tokens/s; goodput "
        f"{_rate(s['goodput_rps'])} req/s under TTFT <= {cfg['slo_ttft_ms']:.0f} ms",
        "",
        "| latency (ms) | n | p50 | p95 | p99 | mean | max |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, st in rows:
        out.append(f"| {name} | {st['n']} | {_ms(st['p50'])} | {_ms(st['p95'])} | {_ms(st['p99'])} | "
                   f"{_ms(st['mean'])} | {_ms(st['max'])} |")
    for long in doc["long"]:
        out.append(f"\nLong prompt ({long['prompt_tokens']} tokens): TTFT {_ms(long['ttft_ms'])} ms.")
    return "\n".join(out) + "\n"


def write_markdown(doc: dict, path: str) -> None:
    write_atomically(path, markdown(doc).encode())


def write_comparison_markdown(docs: list[dict], path: str) -> None:
    text = "\n".join(["# ttftc loadtest: the same load against two servers", ""] + comparison_lines(*docs)) + "\n"
    write_atomically(path, (text + "".join("\n" + markdown(doc) for doc in docs)).encode())


def write_plot(doc: dict, path: str) -> None:
    """Left: each request's TTFT at its arrival time (the SLO as a line). Right: CDFs of TTFT and ITL."""
    plt = pyplot()
    slo = doc["settings"]["slo_ttft_ms"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, marker in (("short", "o"), ("long", "s")):
        points = [(r["scheduled_s"], r["ttft_ms"]) for r in doc["requests"] if r["kind"] == kind and r["ttft_ms"]]
        if points:
            left.scatter(*zip(*points), s=12 if kind == "short" else 40, marker=marker, label=f"{kind} prompts")
    left.axhline(slo, color="red", linestyle="--", label=f"SLO {slo:.0f} ms")
    left.set_xlabel("arrival (s from start)")
    left.set_ylabel("TTFT (ms)")
    left.set_title("TTFT over the run")
    left.legend(fontsize="small")
    left.grid(alpha=0.3)
    done = [r for r in doc["requests"] if r["kind"] == "short" and r["ttft_ms"] is not None and r["end_s"] is not None]
    ttfts = sorted(r["ttft_ms"] for r in done)
    e2e = sorted((r["end_s"] - r["scheduled_s"]) * 1e3 for r in done)
    for name, values in (("TTFT", ttfts), ("end to end", e2e)):
        if values:
            right.plot(values, [(k + 1) / len(values) for k in range(len(values))], label=name)
    right.axvline(slo, color="red", linestyle="--", label=f"SLO {slo:.0f} ms")
    right.set_xscale("log")
    right.set_xlabel("latency (ms)")
    right.set_ylabel("fraction of requests")
    right.set_title("latency CDF")
    right.legend(fontsize="small")
    right.grid(alpha=0.3, which="both")
    fig.suptitle(f"ttftc loadtest: {doc['model']}, rate {doc['settings']['rate']}/s")
    save_figure(fig, path, dpi=110)
