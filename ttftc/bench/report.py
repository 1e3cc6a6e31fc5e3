"""The outputs of a run: the JSON document, a Markdown table, a PNG plot and the ablation table."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
from pathlib import Path
from typing import Optional

from ttftc.cache.atomic import write_bytes
from ttftc.codegen.cpu.measured import BUSY_CORES


def write_atomically(path: str, data: bytes) -> None:
    write_bytes(Path(path), data)


def write_json(doc: dict, path: str) -> None:
    write_atomically(path, (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode())


def _fmt(value: Optional[float], digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def _ms(value: Optional[float]) -> str:
    """Milliseconds with about three significant digits, so a 0.13 ms bound and a 2530 ms TTFT both read well."""
    if value is None:
        return "–"
    digits = 0 if value >= 100 else 1 if value >= 10 else 2 if value >= 1 else 3
    return f"{value:.{digits}f}"


def markdown(doc: dict) -> str:
    model = doc["model"]
    settings = doc["settings"]
    peaks = ", ".join(
        f"{d} {_fmt(v, 0)} {doc['peak_details'][d]['unit']}" for d, v in doc["peak"].items()
    )
    lines = [
        f"# ttftc bench: {os.path.basename(model['name'])}",
        "",
        f"- device: {doc['device']} ({doc['device_name']}, {doc['threads']} threads)",
        f"- capabilities: {doc.get('capabilities') or 'not recorded'}",
        f"- {doc.get('malloc') or 'malloc: not recorded'}",
        f"- {machine_load(doc)}",
        f"- model: {model['parameters'] / 1e6:.1f} M parameters; prefill: {settings['prefill']}",
        f"- workload: {settings['workload']}; {settings['repeats']} measured repeats after {settings['warmup']} "
        f"warm-up runs, variants interleaved; first call: {settings['first_call']}",
        f"- GEMM peak measured in this run: {peaks}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items() if v),
        *(f"- {name}: {note}" for name, note in (doc.get("variant_notes") or {}).items()),
        "",
        "| variant | seq | TTFT p50 ms | p95 ms | p99 ms | first call s | unseen-length call s | bound ms | efficiency "
        "| status |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in doc["results"]:
        unseen = _fmt(r["unseen_len_first_call_s"], 3)
        if r.get("unseen_len") is not None and r["unseen_len_first_call_s"] is not None:
            unseen += f" (at {r['unseen_len']})"
        lines.append(
            f"| {r['variant']} | {r['seq']} | {_ms(r['ttft_ms_p50'])} | {_ms(r['ttft_ms_p95'])} | "
            f"{_ms(r['ttft_ms_p99'])} | {_fmt(r['first_call_s'], 3)} | {unseen} | {_ms(r['bound_ms'])} | "
            f"{_fmt(r['efficiency'], 3)} | {r['status'].replace('|', '/')} |"
        )
    if doc.get("ablation"):
        lines += ["", "## Ablation (ttftc passes on one at a time)", "", ablation_table(doc, markdown=True)]
    if doc.get("workload_table"):
        lines += ["", f"## Workload table ({doc['workload_table']['kind']})", "",
                  workload_table(doc, markdown=True)]
    return "\n".join(lines) + "\n"


def workload_table(doc: dict, *, markdown: bool = False) -> str:
    """The workload's own table (e.g. TTFT per batch size): one row per entry, its keys as columns."""
    rows = doc["workload_table"]["rows"]
    header = list(rows[0])
    cells = [[_ms(v) if isinstance(v, float) else str(v) for v in row.values()] for row in rows]
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        return "\n".join(out + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(x) for x in col) for col in zip(header, *cells)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in [header] + cells)


def write_markdown(doc: dict, path: str) -> None:
    write_atomically(path, markdown(doc).encode())


def ablation_table(doc: dict, *, markdown: bool = False) -> str:
    """TTFT p50 of every ablation step per length, and the change from the previous step."""
    seqs = doc["settings"]["seqs"]
    by_key = {(r["variant"], r["seq"]): r for r in doc["results"]}
    header = ["step"] + [f"p50 ms @{s}" for s in seqs] + [f"vs prev @{s}" for s in seqs]
    rows = []
    previous: dict[int, Optional[float]] = {}
    for step in doc.get("ablation") or []:
        cells, deltas = [], []
        for s in seqs:
            r = by_key.get((step["variant"], s), {})
            p50 = r.get("ttft_ms_p50")
            cells.append(_ms(p50) if p50 is not None else (r.get("status") or "–")[:40])
            before = previous.get(s)
            deltas.append(f"{before / p50:.2f}x" if p50 and before else "–")
            previous[s] = p50
        rows.append([step["step"]] + cells + deltas)
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        out += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(out)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [header] + rows)


def pyplot():
    """pyplot on Agg, the backend that only writes files (importing pyplot does not pick a backend yet)."""
    import matplotlib.pyplot as plt  # lazy: the [bench] extra, which only --plot needs

    plt.switch_backend("Agg")
    return plt


def save_figure(fig, path: str, dpi: int) -> None:
    """Lay out `fig`, write it to `path` as a PNG atomically (a reader never sees half a file), and close it."""
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=dpi)
    finally:
        pyplot().close(fig)
    write_atomically(path, png.getvalue())


def write_plot(doc: dict, path: str) -> None:
    """TTFT p50 against sequence length per variant (p95 as the error bar), with each dtype's bound as a line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 5))
    seqs = doc["settings"]["seqs"]
    for variant in doc["settings"]["variants"]:
        rows = [r for r in doc["results"] if r["variant"] == variant and r["ttft_ms_p50"] is not None]
        if not rows:
            continue
        xs = [r["seq"] for r in rows]
        ys = [r["ttft_ms_p50"] for r in rows]
        upper = [r["ttft_ms_p95"] - r["ttft_ms_p50"] for r in rows]
        ax.errorbar(xs, ys, yerr=[[0] * len(ys), upper], marker="o", capsize=3, label=variant)
    bounds: dict[str, dict[int, float]] = {}
    for r in doc["results"]:
        if r["bound_ms"] is not None:
            bounds.setdefault(r["dtype"], {})[r["seq"]] = r["bound_ms"]
    for dtype, by_seq in sorted(bounds.items()):
        xs = sorted(by_seq)
        ax.plot(xs, [by_seq[x] for x in xs], color="black", linestyle={"fp32": "--", "bf16": ":"}.get(dtype, "-."),
                label=f"roofline bound {dtype}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqs)
    ax.set_xticklabels([str(s) for s in seqs])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms), p50; bar to p95")
    ax.set_title(f"ttftc bench: {os.path.basename(doc['model']['name'])} on {doc['device']} ({doc['threads']} threads)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over the data
    save_figure(fig, path, dpi=120)


def machine_load(doc: dict) -> str:
    """What else ran while the variants were timed (runner.py measures it from /proc/stat)."""
    busy, cores = doc.get("others_busy_cores"), doc.get("cores")
    if busy is None:
        return "machine load while timing: not recorded"
    verdict = "a shared machine: compare ratios within this run only" if busy > BUSY_CORES else "a quiet machine"
    return f"machine load while timing: other processes used {busy:.2f} of {cores} cores on average ({verdict})"


def summary_lines(doc: dict) -> list[str]:
    """A compact table for the terminal."""
    out = [f"{doc['device_name']}: {doc['capabilities']}"] if doc.get("capabilities") else []
    if doc.get("malloc"):
        out.append(doc["malloc"])
    out.append(machine_load(doc))
    out += [f"{name}: {note}" for name, note in (doc.get("variant_notes") or {}).items()]
    out.append(f"{'variant':<44}{'seq':>6}{'p50 ms':>10}{'p95 ms':>10}{'first s':>9}{'unseen s':>10}{'bound ms':>10}"
               f"{'eff':>7}  status")
    for r in doc["results"]:
        out.append(
            f"{r['variant']:<44}{r['seq']:>6}{_ms(r['ttft_ms_p50']):>10}{_ms(r['ttft_ms_p95']):>10}"
            f"{_fmt(r['first_call_s'], 3):>9}{_fmt(r['unseen_len_first_call_s'], 3):>10}{_ms(r['bound_ms']):>10}"
            f"{_fmt(r['efficiency'], 3):>7}  {r['status']}"
        )
    if doc.get("workload_table"):
        out += ["", f"workload table ({doc['workload_table']['kind']}):", workload_table(doc)]
    return out


def plot_available() -> Optional[str]:
    """None when matplotlib is installed, else why --plot cannot work."""
    if importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'ttftc[bench]'"
    return None

