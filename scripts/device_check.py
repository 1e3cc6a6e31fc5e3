"""The device check: everything a rare, short, offline GPU session must prove, in one command.

    scripts/device_check.sh              # on the GPU machine, from the copied tree
    scripts/device_check.sh --dry-run    # on CPU: tiny shapes, TRITON_INTERPRET=1 (CI runs this)

Steps, in order of importance, each a subprocess with its own timeout inside one total deadline (a step that
fails or times out is recorded and the next one runs):
 1. install ttftc from this tree with no network (pip -e, --no-deps --no-build-isolation --no-index: the torch
    and triton already there stay); where that fails, later steps import the tree through PYTHONPATH
 2. tests/gpu: every Triton kernel and the zoo end to end against torch references, errors to gpu-errors.jsonl
 3. `ttftc autotune` of attention for one shape, then attention TFLOP/s (default and tuned config, CUDA events)
    against the GPU's bf16 peak (published, and torch.mm's measured in the same process)
 4. `ttftc bench` of smol-135m and of a 1B-shaped Llama in bf16 at 512, 2048 and 8192 tokens: eager SDPA,
    Inductor, ttftc with both code generators; then Inductor max-autotune (CUDA graphs) as a step of its own,
    since its tuning may not fit the time left
Results go to $OUT (./device-results where unset), at most 8 files: summary.md, steps.json, gpu-errors.jsonl,
attention.json and one JSON per bench step.

The models are written to a scratch directory as Hugging Face checkpoints with random weights (seed 0): the
presets' 8192 positions leave no room for the bench's unseen-length probe past 8192 tokens, and the 1B shape is
no preset.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
# The plan reads the zoo's presets before the install step has run: import ttftc from this tree.
sys.path.insert(0, str(ROOT))
from ttftc import zoo  # noqa: E402

MAX_FILES = 8
LOG_TAIL = 4000


STEPS = ("install", "tests", "attention", "bench", "max-autotune")


@dataclass(frozen=True)
class Plan:
    """What one run does: real shapes on the GPU, or the same steps at toy sizes on CPU."""

    dry_run: bool
    device: str
    deadline_s: float
    seqs: tuple[int, ...]
    bench_repeats: int
    models: dict  # name -> HF config overrides of the written checkpoint
    peers: tuple[str, ...]
    max_autotune: tuple[str, ...]  # variants of the separate max-autotune step (none: skipped)
    attention: dict  # the autotuned attention problem
    budgets: dict  # step -> its own timeout, seconds
    # False: a step runs until it ends, and only the total deadline bounds it (for a CPU whose speed nobody knows:
    # a loaded 2-core CI machine takes several times a step's budget, which only a GPU session needs)
    step_timeouts: bool = True

    @staticmethod
    def make(dry_run: bool, deadline_s: Optional[float]) -> "Plan":
        smol = dict(zoo.PRESETS["smol-135m"][1])
        one_b = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
        if dry_run:
            # The same two checkpoints' layout (GQA, tied embeddings) at toy sizes.
            tiny = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1)
            smol = {**smol, **tiny, "num_attention_heads": 4, "num_key_value_heads": 2}
            one_b = {**one_b, **tiny, "num_attention_heads": 4, "num_key_value_heads": 1}
            return Plan(True, "cpu", deadline_s or 480.0, (16, 32, 64), 2,
                        {"smol-135m": smol, "1b": one_b},
                        ("eager-sdpa-bf16", "ttftc-bf16"), (),
                        dict(model="smol-135m", bucket=32),
                        dict(install=120, tests=200, attention=60, bench=100, max_autotune=0))
        return Plan(False, "cuda", deadline_s or 420.0, (512, 2048, 8192), 5,
                    {"smol-135m": smol, "1b": one_b},
                    ("eager-sdpa-bf16", "inductor-bf16", "ttftc-bf16", "ttftc[precision=bf16,codegen=inductor]"),
                    ("inductor-max-autotune-bf16",),
                    dict(model="1b", bucket=8192),
                    dict(install=120, tests=170, attention=75, bench=110, max_autotune=90))


@dataclass
class StepResult:
    name: str
    status: str  # "ok", "failed: ...", "timed out after N s", "skipped: ..."
    seconds: float
    command: list = field(default_factory=list)
    log_tail: str = ""
    data: dict = field(default_factory=dict)


class Runner:
    def __init__(self, plan: Plan, out: Path, work: Path):
        self.plan, self.out, self.work = plan, out, work
        self.started = time.monotonic()
        self.results: list[StepResult] = []
        self.env = dict(os.environ)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["TTFTC_CACHE_DIR"] = str(work / "ttftc-cache")  # nothing of the user's cache is read or kept
        if plan.dry_run:
            self.env["TRITON_INTERPRET"] = "1"
            self.env["TTFTC_GPU_DRY_RUN"] = "1"

    def left(self) -> float:
        return self.plan.deadline_s - (time.monotonic() - self.started)

    def run(self, name: str, command: list, budget: float, *, env: Optional[dict] = None) -> StepResult:
        """Run `command` with at most `budget` seconds (and never past the deadline, keeping 10 s to summarise)."""
        room = self.left() - 10
        if room < 5:
            return self.record(StepResult(name, "skipped: the total deadline is reached", 0.0, command))
        timeout = min(budget, room) if self.plan.step_timeouts else room
        started = time.monotonic()
        log = self.work / ("".join(c if c.isalnum() else "-" for c in name) + ".log")
        with open(log, "wb") as sink:
            # A session of its own, so a timeout ends the step's children too (compile workers, cold starts).
            proc = subprocess.Popen(command, cwd=ROOT, env=env or self.env, stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
                status = "ok" if rc == 0 else f"failed: exit status {rc}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status = f"timed out after {timeout:.0f} s"
        tail = log.read_bytes()[-LOG_TAIL:].decode(errors="replace")
        return self.record(StepResult(name, status, time.monotonic() - started, command, tail))

    def record(self, result: StepResult) -> StepResult:
        self.results.append(result)
        print(f"[device-check] {result.name}: {result.status} ({result.seconds:.0f} s, {self.left():.0f} s left)",
              flush=True)
        return result


def _python(*args: str) -> list:
    return [sys.executable, *args]


def step_install(r: Runner) -> bool:
    pip = _python("-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation")
    if r.plan.dry_run:
        pip.append("--dry-run")  # resolves and builds the metadata, installs nothing into this environment
    return r.run("install", [*pip, "-e", str(ROOT)], r.plan.budgets["install"]).status == "ok"


def step_environment(r: Runner, installed: bool) -> None:
    if not installed or r.plan.dry_run:
        # Later steps import this tree all the same; the summary says whether the install is what failed.
        r.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), r.env.get("PYTHONPATH")]))
    probe = r.run("environment", _python("-c", _ENV_PROBE), 60)
    try:
        probe.data = json.loads(probe.log_tail.strip().splitlines()[-1])
    except (ValueError, IndexError):
        probe.data = {}


_ENV_PROBE = """
import json, os, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
try:
    import triton; info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
try:
    import transformers; info["transformers"] = transformers.__version__
except ImportError:
    info["transformers"] = None
import ttftc
info["ttftc_from"] = os.path.dirname(ttftc.__file__)
from ttftc.codegen.cpu import _native
info["native_kernels"] = _native.isa() or f"not built: {_native.unavailable_reason()}"
print(json.dumps(info))
"""


def step_tests(r: Runner) -> None:
    errors = r.work / "gpu-errors.jsonl"
    env = {**r.env, "TTFTC_GPU_ERRORS": str(errors)}
    report = r.work / "junit.xml"
    # --durations: the slowest tests end the log tail steps.json keeps, to size the next run's budgets
    result = r.run("tests/gpu", _python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "--durations=8",
                                        f"--junitxml={report}", "tests/gpu"), r.plan.budgets["tests"], env=env)
    rows = _read_jsonl(errors)
    result.data = {"errors": _max_errors(rows), "outcomes": _outcomes(report)}
    if errors.exists():
        shutil.copy(errors, r.out / "gpu-errors.jsonl")


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _max_errors(rows: list[dict]) -> list[dict]:
    """Per (kernel, dtype): the largest error, its case, the largest share of its bound used, failures."""
    table: dict[tuple, dict] = {}
    for row in rows:
        if not isinstance(row.get("max_abs_err"), (int, float)):
            continue
        key = (str(row.get("kernel")), str(row.get("dtype")))
        entry = table.setdefault(key, {"kernel": key[0], "dtype": key[1], "checks": 0, "failed": 0,
                                       "max_abs_err": -1.0, "worst_case": None, "max_share_of_bound": 0.0})
        entry["checks"] += 1
        entry["failed"] += 0 if row.get("passed") else 1
        if row["max_abs_err"] > entry["max_abs_err"]:
            entry["max_abs_err"], entry["worst_case"] = row["max_abs_err"], row.get("case")
        bound = row.get("bound")
        if isinstance(bound, (int, float)) and bound > 0:
            entry["max_share_of_bound"] = max(entry["max_share_of_bound"], row["max_abs_err"] / bound)
    return sorted(table.values(), key=lambda e: (e["kernel"], e["dtype"]))


def _outcomes(junit: Path) -> dict:
    """passed/failed/skipped counts and the failed test ids, from pytest's JUnit XML."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    if not junit.exists():
        return counts
    try:
        cases = ET.parse(junit).getroot().iter("testcase")
    except ET.ParseError:
        return counts
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def step_models(r: Runner) -> dict[str, Path]:
    """Write each bench model as a local checkpoint; returns name -> directory for those written."""
    written = {}
    for name, overrides in r.plan.models.items():
        directory = _write_model(r, name, overrides)
        if directory is not None:
            written[name] = directory
    return written


def _write_model(r: Runner, name: str, overrides: dict) -> Optional[Path]:
    directory = r.work / "models" / name
    spec = json.dumps({**overrides, "max_position_embeddings": max(r.plan.seqs) + 256})
    result = r.run(f"model {name}", _python("-c", _WRITE_MODEL, str(directory), spec), 150)
    return directory if result.status == "ok" else None


_WRITE_MODEL = """
import sys, json, torch
from ttftc import zoo
torch.manual_seed(0)
from transformers import AutoModelForCausalLM
config = zoo.config("llama", **json.loads(sys.argv[2]))
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init of 1B weights is slow on CPU
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
"""


def step_bench(r: Runner, models: dict[str, Path], variants: tuple[str, ...], label: str, budget: float) -> None:
    for name in r.plan.models:
        step = f"bench {name}{label}"
        if not variants:
            r.record(StepResult(step, "skipped: no variants on this machine (max-autotune on CPU takes minutes)",
                                0.0))
            continue
        if name not in models:
            r.record(StepResult(step, f"skipped: the {name} checkpoint was not written", 0.0))
            continue
        target = r.out / f"bench-{name}{label.replace(' ', '-')}.json"
        command = _python("-m", "ttftc.cli", "bench", str(models[name]), "--device", r.plan.device,
                          "--seq", ",".join(map(str, r.plan.seqs)), "--variants", ",".join(variants),
                          "--repeats", str(r.plan.bench_repeats), "--warmup", "1", "--first-call", "skip",
                          "--no-progress", "--json", str(target))
        result = r.run(step, command, budget)
        if target.exists():
            try:
                result.data = {"file": target.name, **_bench_table(json.loads(target.read_text()))}
            except ValueError as exc:
                result.data = {"file": target.name, "error": f"unreadable JSON: {exc}"}


def _bench_table(doc: dict) -> dict:
    rows = []
    for row in doc.get("results", []):
        rows.append({k: row.get(k) for k in ("variant", "seq", "status", "ttft_ms_p50", "bound_ms", "efficiency",
                                             "published_bound_ms", "published_efficiency")})
    return {"rows": rows, "timing": (doc.get("settings") or {}).get("timing"), "peak_gflops": doc.get("peak"),
            "device_name": doc.get("device_name")}


def step_attention(r: Runner) -> None:
    problem = r.plan.attention
    cache = r.work / "autotune"
    config = r.plan.models[problem["model"]]
    # One layer of the model: the same attention problem (the cache keys on the op's shapes), without compiling
    # every other layer first.
    model = _write_model(r, f"{problem['model']}-1-layer", {**config, "num_hidden_layers": 1})
    if model is None:
        r.record(StepResult("autotune attention", "skipped: its checkpoint was not written", 0.0))
    else:
        search_s = str(r.plan.budgets["attention"] // 3)  # the rest: loading, compiling, the timing after it
        r.run("autotune attention", _python("-m", "ttftc.cli", "autotune", str(model), "--buckets",
                                            str(problem["bucket"]), "--ops", "attention", "--provider", "triton",
                                            "--precision", "bf16", "--budget-s", search_s, "--cache", str(cache)),
              r.plan.budgets["attention"])
    target = r.work / "attention-throughput.json"
    spec = json.dumps(dict(heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
                           head_dim=config["hidden_size"] // config["num_attention_heads"], seq=problem["bucket"],
                           cache=str(cache), out=str(target)))
    result = r.run("attention TFLOP/s", _python(str(Path(__file__).with_name("device_check_attention.py")), spec),
                   r.plan.budgets["attention"])
    if target.exists():
        try:
            result.data = json.loads(target.read_text())
        except ValueError as exc:
            result.data = {"error": f"unreadable JSON: {exc}"}
        shutil.copy(target, r.out / "attention.json")


def summary_markdown(r: Runner) -> str:
    plan = r.plan
    env = next((s.data for s in r.results if s.name == "environment"), {})
    lines = [f"# ttftc device check{' (dry run on CPU: tiny shapes, Triton interpreter)' if plan.dry_run else ''}",
             "", f"- GPU: {env.get('gpu') or 'none'}; torch {env.get('torch')} (CUDA {env.get('cuda')}), triton "
             f"{env.get('triton')}, transformers {env.get('transformers')}, Python {env.get('python')}",
             f"- ttftc imported from {env.get('ttftc_from')}; native CPU kernels: {env.get('native_kernels')}",
             f"- wall time {time.monotonic() - r.started:.0f} s of a {plan.deadline_s:.0f} s deadline", "",
             "## Steps", "", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.0f} |" for s in r.results]
    tests = next((s for s in r.results if s.name == "tests/gpu"), None)
    if tests is not None:
        outcomes = tests.data.get("outcomes", {})
        lines += ["", "## Kernels against their references (tests/gpu)", "",
                  f"{outcomes.get('passed', 0)} passed, {outcomes.get('failed', 0)} failed, "
                  f"{outcomes.get('skipped', 0)} skipped."]
        lines += [f"- FAILED {name}" for name in outcomes.get("failures", [])[:20]]
        lines += ["", "| kernel | dtype | checks | failed | max abs error | worst case | max share of bound |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {e['kernel']} | {e['dtype']} | {e['checks']} | {e['failed']} | {e['max_abs_err']:.3g} | "
                  f"{e['worst_case']} | {e['max_share_of_bound']:.2f} |" for e in tests.data.get("errors", [])]
    attention = next((s for s in r.results if s.name == "attention TFLOP/s"), None)
    if attention is not None and attention.data.get("configs"):
        d = attention.data
        lines += ["", f"## Attention throughput ({d.get('shape')})", "",
                  "| kernel | config | ms | TFLOP/s | of published bf16 peak | of measured torch.mm bf16 |",
                  "|---|---|---|---|---|---|"]
        for c in d["configs"]:
            lines.append(f"| {c['kernel']} | {c.get('config')} | {_fmt(c.get('ms'))} | {_fmt(c.get('tflops'))} | "
                         f"{_pct(c.get('of_published_peak'))} | {_pct(c.get('of_measured_peak'))} |")
        lines.append(f"\nPublished bf16 peak: {d.get('published_peak_tflops')} TFLOP/s ({d.get('published_device')});"
                     f" measured torch.mm bf16: {_fmt(d.get('measured_mm_tflops'))} TFLOP/s.")
    bench = [s for s in r.results if s.name.startswith("bench ") and s.data.get("rows")]
    if bench:
        lines += ["", "## TTFT p50 (ms) per variant and length", ""]
        for s in bench:
            lines += [f"### {s.name} ({s.data.get('device_name')}; timing: {s.data.get('timing')})", "",
                      "| variant | " + " | ".join(str(q) for q in plan.seqs) + " |",
                      "|---|" + "---|" * len(plan.seqs)]
            by_variant: dict[str, dict] = {}
            for row in s.data["rows"]:
                by_variant.setdefault(row["variant"], {})[row["seq"]] = row
            for variant, cells in by_variant.items():
                lines.append(f"| {variant} | " + " | ".join(_cell(cells.get(q)) for q in plan.seqs) + " |")
            bound = {q: next((c.get("published_bound_ms") or c.get("bound_ms") for c in
                              (v.get(q) for v in by_variant.values()) if c and c.get("status") == "ok"), None)
                     for q in plan.seqs}
            lines += ["| roofline bound (bf16 peak) | " + " | ".join(_fmt(bound[q]) for q in plan.seqs) + " |", ""]
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else "-"


def _pct(value) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "-"


def _cell(row: Optional[dict]) -> str:
    if row is None:
        return "-"
    if row.get("status") != "ok":
        return str(row.get("status"))[:60].replace("|", "/")
    return _fmt(row.get("ttft_ms_p50"))


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, TRITON_INTERPRET=1")
    parser.add_argument("--deadline-s", type=float, default=None, help="total wall time (default 420, dry run 480)")
    parser.add_argument("--no-step-timeouts", action="store_true",
                        help="let each step run until it ends; only --deadline-s bounds the run")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated subset of {','.join(STEPS)}, e.g. to rerun what a first run missed")
    args = parser.parse_args(argv)
    if args.deadline_s is not None and args.deadline_s <= 0:
        parser.error(f"--deadline-s must be positive, got {args.deadline_s}")
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown or not steps:
        parser.error(f"--steps: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(STEPS)}")
    if not args.dry_run and not torch.cuda.is_available():
        print("device check: no CUDA device here; run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT") or ROOT / "device-results")
    out.mkdir(parents=True, exist_ok=True)
    plan = replace(Plan.make(args.dry_run, args.deadline_s), step_timeouts=not args.no_step_timeouts)
    with tempfile.TemporaryDirectory(prefix="ttftc-device-check-") as scratch:
        runner = Runner(plan, out, Path(scratch))
        step_environment(runner, "install" in steps and step_install(runner))
        if "tests" in steps:
            step_tests(runner)
        if "attention" in steps:
            step_attention(runner)
        models = step_models(runner) if {"bench", "max-autotune"} & set(steps) else {}
        if "bench" in steps:
            step_bench(runner, models, plan.peers, "", plan.budgets["bench"])
        if "max-autotune" in steps:
            step_bench(runner, models, plan.max_autotune, " max-autotune", plan.budgets["max_autotune"])
        (out / "steps.json").write_text(json.dumps({"plan": asdict(plan), "steps": [asdict(s) for s in
                                                                                    runner.results]}, indent=1))
        (out / "summary.md").write_text(summary_markdown(runner))
    written = sorted(p.name for p in out.iterdir())
    print(f"[device-check] {out} holds {', '.join(written)}")
    if len(written) > MAX_FILES:  # files that were there before this run: the session returns only 8
        print(f"[device-check] warning: {len(written)} files in {out}, at most {MAX_FILES} come back; give an "
              "empty $OUT", file=sys.stderr)
    return 0 if all(s.status == "ok" or s.status.startswith("skipped") for s in runner.results) else 1


if __name__ == "__main__":
    sys.exit(main())
