"""The four layers (ARCHITECTURE.md): import-linter's contract in .importlinter holds, and it would catch a break."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"

pytest.importorskip("importlinter", reason="import-linter is a dev dependency: pip install -e '.[dev]'")


def _lint(root: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH first: the tree at `root` is the one analysed, not the installed one.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_every_module_imports_only_from_its_layer_and_below():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "tools > serving > deploy > core KEPT" in done.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "ttftc", tmp_path / "ttftc", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    base = tmp_path / "ttftc" / "passes" / "base.py"
    base.write_text(base.read_text() + "\nimport ttftc.serve  # core reaching up into serving\n")
    done = _lint(tmp_path)
    assert done.returncode == 1, done.stdout[-4000:]
    assert "ttftc.passes.base -> ttftc.serve" in done.stdout and "BROKEN" in done.stdout
