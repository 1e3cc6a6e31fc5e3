"""`ttftc explain --device`: the TTFT prediction from published peaks, per-op bounds and the kernel configs."""

from tests.bench.helpers import error_lines, run_cli
from tests.helpers import needs_transformers

pytestmark = needs_transformers


def test_h100_prediction_with_bounds_and_kernel_configs(capsys):
    status, out, err = run_cli(["explain", "tiny", "--seq", "32", "--device", "h100"], capsys)
    assert status == 0, err
    assert "prediction for NVIDIA H100 SXM5 80GB" in out and "source: NVIDIA H100" in out
    assert "predicted TTFT >=" in out and "limited by" in out
    assert "kernel configs on sm_90 (NVIDIA H100)" in out
    assert "ttftc.attention" in out and "_attention_fwd block_m=" in out
    assert "GEMM peak measured now" not in out  # no CPU measurement when a device is named


def test_910b_prediction_says_its_figures_are_approximate(capsys):
    status, out, err = run_cli(["explain", "tiny", "--seq", "16", "--device", "910b"], capsys)
    assert status == 0, err
    assert "Huawei Ascend 910B" in out and "approximate" in out
    assert "_attention_fwd_persistent" in out  # triton-ascend's persistent kernel, grid = cube cores


def test_unknown_device_is_refused(capsys):
    status, _, err = run_cli(["explain", "tiny", "--device", "v100"], capsys)
    assert status == 2 and "unknown device 'v100': expected one of a100, h100" in error_lines(err)[-1]
