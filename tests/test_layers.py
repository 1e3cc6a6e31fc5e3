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


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_no_import_cycles_between_modules_or_packages_counting_imports_inside_functions():
    done = _script("import_cycles.py", "ttftc")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 module cycles, 0 package cycles in ttftc" in done.stdout


def test_imports_inside_functions_are_few_and_each_gives_its_reason():
    done = _script("count_function_imports.py", "ttftc", "--check", "30")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function(tmp_path):
    package = tmp_path / "loop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("import loop.b\n")
    (package / "b.py").write_text("def f():\n    import loop.a\n")
    (package / "c.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_cycles.py"), "loop"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "module cycle: loop.a <-> loop.b" in done.stdout


def test_the_import_count_refuses_an_import_without_its_reason(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    import json  # lazy: a reason\n\n\ndef g():\n    import csv\n")
    done = _script("count_function_imports.py", str(tmp_path), "--check", "30")
    assert done.returncode == 1
    assert "m.py:6\tg\tcsv\t(no # lazy: reason)" in done.stdout
    assert "2 imports inside functions" in done.stdout and "1 without" in done.stdout
