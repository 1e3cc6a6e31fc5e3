"""Shared pieces of the bench tests: running the CLI in-process and the JSON contract."""

from __future__ import annotations

import pytest

from ttftc import cli

# The keys the JSON contract requires of every result row.
CONTRACT_ROW_KEYS = {
    "variant", "seq", "ttft_ms_p50", "ttft_ms_p95", "ttft_ms_p99", "first_call_s", "bound_ms", "efficiency", "status",
}

# Small and quick: the tiny preset, short prompts, a small GEMM for the peak, no progress bar.
FAST = ["--repeats", "2", "--warmup", "1", "--peak-size", "256", "--no-progress"]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `ttftc ARGV`, run in this process."""
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse exits on its own errors
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def error_lines(err: str) -> list[str]:
    """stderr lines, minus logging noise third-party libraries may print while importing."""
    return [line for line in err.splitlines() if line.strip()]
