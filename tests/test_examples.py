"""The runnable examples run, and say what they promise (tiny sizes: speed is measured by `ttftc bench`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import needs_transformers

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@needs_transformers
def test_prompt_cache_example_reuses_the_system_prompt_without_a_tenant():
    run = subprocess.run([sys.executable, str(EXAMPLES / "prompt_cache.py"), "--system", "40", "--question", "8",
                          "--calls", "2", "--layers", "1", "--eager"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [(row[0], row[-1]) for row in rows] == [("1", "0"), ("2", "32")], run.stdout  # 2 full blocks of 16
    assert "x the cold TTFT" in run.stdout
