"""`ttftc kernels`: the table, the JSON, the exit status, and bad input."""

import dataclasses
import json

from tests.bench.helpers import error_lines, run_cli
from tests.helpers import needs_triton
from ttftc.codegen.triton import targets as targets_module

pytestmark = needs_triton


def test_compiles_the_norm_kernels_and_writes_json(capsys, tmp_path):
    out_file = tmp_path / "kernels.json"
    status, out, err = run_cli(["kernels", "--target", "sm_90", "--ops", "norm_linear", "--defaults-only",
                                "--json", str(out_file)], capsys)
    assert status == 0, err
    assert "_norm_kernel" in out and "sm_90 (NVIDIA H100): 6/6 configs pass" in out
    payload = json.loads(out_file.read_text())
    assert payload["targets"]["sm_90"]["shared_memory_per_block"] == 232448
    rows = payload["results"]
    assert len(rows) == 6 and all(r["ok"] and r["registers"] > 0 and r["failures"] == [] for r in rows)


def test_a_config_over_the_targets_limit_fails_the_run(capsys, monkeypatch):
    # A GPU with 1 KB of shared memory: the gated-FFN GEMM tiles cannot fit, so the run must exit 1.
    tiny = dataclasses.replace(targets_module.get_target("sm_90"), name="tiny", shared_memory_per_block=1024)
    known = dict(targets_module.all_targets(), tiny=tiny)
    monkeypatch.setattr(targets_module, "all_targets", lambda: known)
    status, out, _ = run_cli(["kernels", "--target", "tiny", "--ops", "gated_ffn", "--defaults-only"], capsys)
    assert status == 1
    assert "FAIL" in out and "shared memory" in out and "0/3 configs pass" in out


def test_unknown_target_or_op_is_a_usage_error(capsys):
    status, _, err = run_cli(["kernels", "--target", "sm_75"], capsys)
    assert status == 2 and "unknown target 'sm_75'" in error_lines(err)[-1]
    status, _, err = run_cli(["kernels", "--target", "sm_90", "--ops", "softmax"], capsys)
    assert status == 2 and "unknown op(s) softmax" in error_lines(err)[-1]
    status, _, err = run_cli(["kernels", "--jobs", "0"], capsys)
    assert status == 2 and "--jobs" in error_lines(err)[-1]
    status, _, err = run_cli(["kernels", "--json", "/nonexistent-dir/k.json"], capsys)
    assert status == 2 and "directory does not exist" in error_lines(err)[-1]
