"""scripts/device_check.sh: its bookkeeping (deadline, timeouts, summaries) here, and the whole script on CPU
in its --dry-run (about 2.5 minutes on an idle 2-core machine, in every CI run), so it cannot rot between GPU
sessions. The dry run here has no step timeouts: a loaded machine takes several times a GPU session's budgets, and
the timeouts' bookkeeping has its own tests below."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_check.sh"


def _load():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


dc = _load()


HANG_GUARD_S = 3 * 3600


def _runner(tmp_path, deadline_s=60.0):
    plan = dc.Plan.make(True, deadline_s)
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    return dc.Runner(plan, out, work)


def test_a_step_past_its_timeout_is_killed_with_its_children_and_the_next_step_runs(tmp_path):
    r = _runner(tmp_path)
    marker = tmp_path / "grandchild-finished"
    # the step starts a grandchild that would write the marker after 3 s; the timeout must end it too
    child = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
             f"\"import time; time.sleep(3); open({str(marker)!r}, 'w')\"]); time.sleep(30)")
    started = time.monotonic()
    slow = r.run("slow", [sys.executable, "-c", child], 1.5)
    assert slow.status.startswith("timed out") and time.monotonic() - started < 10
    failing = r.run("failing", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 30)
    assert failing.status == "failed: exit status 3" and "boom" in failing.log_tail
    time.sleep(4)
    assert not marker.exists(), "the timed-out step's grandchild kept running"
    assert [s.name for s in r.results] == ["slow", "failing"]


def test_without_step_timeouts_a_step_outlives_its_budget_and_only_the_deadline_bounds_it(tmp_path):
    r = _runner(tmp_path)
    r.plan = dc.replace(r.plan, step_timeouts=False)
    slow = r.run("slow", [sys.executable, "-c", "import time; time.sleep(2)"], 0.5)  # 4x its budget
    assert slow.status == "ok", slow.status
    (tmp_path / "late").mkdir()
    late = _runner(tmp_path / "late", deadline_s=12.0)
    late.plan = dc.replace(late.plan, step_timeouts=False)
    assert late.run("late", [sys.executable, "-c", "pass"], 60).status.startswith("skipped: the total deadline")


def test_steps_past_the_deadline_are_skipped_not_started(tmp_path):
    r = _runner(tmp_path, deadline_s=12.0)  # 10 s are kept for the summary: less than 5 s are left for steps
    result = r.run("late", [sys.executable, "-c", "open('never', 'w')"], 60)
    assert result.status.startswith("skipped: the total deadline")
    assert not (dc.ROOT / "never").exists()


def test_max_error_per_kernel_and_dtype():
    rows = [
        {"kernel": "attention", "dtype": "bfloat16", "case": "1b causal", "max_abs_err": 0.01, "bound": 0.05,
         "passed": True},
        {"kernel": "attention", "dtype": "bfloat16", "case": "1b window", "max_abs_err": 0.04, "bound": 0.03,
         "passed": False},
        {"kernel": "attention", "dtype": "float16", "case": "x", "max_abs_err": 0.001, "bound": 0.004, "passed": True},
        {"kernel": "zoo first token", "dtype": "fp32", "same_first_token": True},  # no error: not in the table
    ]
    table = {(e["kernel"], e["dtype"]): e for e in dc._max_errors(rows)}
    assert set(table) == {("attention", "bfloat16"), ("attention", "float16")}
    bf16 = table["attention", "bfloat16"]
    assert (bf16["checks"], bf16["failed"], bf16["max_abs_err"], bf16["worst_case"]) == (2, 1, 0.04, "1b window")
    assert bf16["max_share_of_bound"] == pytest.approx(0.04 / 0.03)


def test_outcomes_from_junit_xml(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text('<testsuites><testsuite><testcase classname="tests.gpu.a" name="ok"/>'
                      '<testcase classname="tests.gpu.a" name="bad"><failure message="x"/></testcase>'
                      '<testcase classname="tests.gpu.a" name="skip"><skipped/></testcase></testsuite></testsuites>')
    outcomes = dc._outcomes(report)
    assert (outcomes["passed"], outcomes["failed"], outcomes["skipped"]) == (1, 1, 1)
    assert outcomes["failures"] == ["tests.gpu.a::bad"]
    (tmp_path / "broken.xml").write_text("<testsuites><testcase")
    assert dc._outcomes(tmp_path / "broken.xml")["failed"] == 0


def test_summary_tables(tmp_path):
    r = _runner(tmp_path)
    r.record(dc.StepResult("environment", "ok", 1.0, data={"gpu": "NVIDIA H200", "torch": "2.11.0"}))
    r.record(dc.StepResult("tests/gpu", "failed: exit status 1", 90.0, data={
        "outcomes": {"passed": 3, "failed": 1, "skipped": 0, "failures": ["tests/gpu/test_kernels.py::t"]},
        "errors": dc._max_errors([{"kernel": "rope", "dtype": "bfloat16", "case": "1b", "max_abs_err": 0.002,
                                   "bound": 0.03, "passed": True}])}))
    rows = [{"variant": "ttftc-bf16", "seq": s, "status": "ok", "ttft_ms_p50": 2.0 * s, "bound_ms": 0.1,
             "published_bound_ms": 0.05} for s in r.plan.seqs]
    rows[-1] = {"variant": "ttftc-bf16", "seq": r.plan.seqs[-1], "status": "failed: out of memory"}
    r.record(dc.StepResult("bench 1b", "ok", 60.0, data={"rows": rows, "timing": "CUDA events"}))
    text = dc.summary_markdown(r)
    assert "NVIDIA H200" in text and "| tests/gpu | failed: exit status 1 |" in text
    assert "FAILED tests/gpu/test_kernels.py::t" in text and "| rope | bfloat16 | 1 | 0 | 0.002 | 1b |" in text
    assert "timing: CUDA events" in text and "failed: out of memory" in text
    assert "| roofline bound (bf16 peak) | 0.05 | 0.05 | - |" in text  # the published GPU peak's bound, where known


def test_bad_arguments_and_a_machine_without_cuda_exit_2(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    for args in (["--steps", "tests,nonsense"], ["--deadline-s", "-1"]):
        done = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 2 and "--" in done.stderr, done.stderr
    if not torch.cuda.is_available():
        done = subprocess.run([str(SCRIPT), "--steps", "tests"], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 2 and "--dry-run" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists(), "refused runs write nothing"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU stand-in for a GPU run")
def test_dry_run_runs_every_step_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out)}
    # The deadline only guards against a hang: no machine that finishes the run at all comes near it.
    done = subprocess.run([str(SCRIPT), "--dry-run", "--no-step-timeouts", "--deadline-s", str(HANG_GUARD_S)],
                          capture_output=True, text=True, env=env, timeout=HANG_GUARD_S + 120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"summary.md", "steps.json", "gpu-errors.jsonl", "attention.json",
                                "bench-smol-135m.json", "bench-1b.json"} <= set(files)
    record = json.loads((out / "steps.json").read_text())
    assert record["plan"]["step_timeouts"] is False
    steps = {s["name"]: s for s in record["steps"]}
    assert all(s["status"] == "ok" for n, s in steps.items() if "max-autotune" not in n), steps
    outcomes = steps["tests/gpu"]["data"]["outcomes"]
    assert outcomes["failed"] == 0 and outcomes["skipped"] == 0 and outcomes["passed"] >= 30
    kernels = {e["kernel"] for e in steps["tests/gpu"]["data"]["errors"]}
    assert {"attention", "gated_ffn", "linear_act", "norm", "norm_linear", "rope", "int8_gemm", "quantize_rows",
            "zoo logits", "aot logits"} <= kernels
    for name in ("smol-135m", "1b"):
        bench = json.loads((out / f"bench-{name}.json").read_text())
        assert {r["status"] for r in bench["results"]} == {"ok"} and bench["settings"]["seqs"] == [16, 32, 64]
    attention = json.loads((out / "attention.json").read_text())
    assert [c["kernel"] for c in attention["configs"]][0] == "ttftc triton" and attention["configs"][0]["ms"] > 0
    summary = (out / "summary.md").read_text()
    assert "dry run" in summary and "## TTFT p50" in summary and "## Attention throughput" in summary
