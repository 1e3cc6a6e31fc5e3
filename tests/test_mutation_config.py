"""scripts/mutation.py and the [tool.mutmut] table of pyproject.toml describe the same modules and test files, and
every path they name exists (a renamed test file would otherwise leave its modules without killers)."""

from __future__ import annotations

import glob
import importlib.util
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("mutation_script", REPO / "scripts" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_pyproject_lists_the_union_of_the_groups_and_every_path_exists():
    script = _script()
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mutmut"]
    modules = [m for group in script.GROUPS.values() for m in group.modules]
    tests = [t for group in script.GROUPS.values() for t in group.tests]
    assert sorted(table["only_mutate"]) == sorted(set(modules))
    assert sorted(table["pytest_add_cli_args_test_selection"]) == sorted(set(tests))
    for pattern in modules:
        assert glob.glob(str(REPO / pattern)), f"{pattern} matches no module"
    for test in tests:
        assert (REPO / test).is_file(), f"{test} does not exist"


def test_a_group_config_replaces_only_the_mutmut_table():
    script = _script()
    pyproject = (REPO / "pyproject.toml").read_text()
    rewritten = tomllib.loads(script._with_group_config(pyproject, script.GROUPS["scheduler"]))
    original = tomllib.loads(pyproject)
    assert rewritten["project"] == original["project"] and rewritten["tool"]["pytest"] == original["tool"]["pytest"]
    mutmut = rewritten["tool"]["mutmut"]
    assert mutmut["only_mutate"] == ["ttftc/runtime/scheduler.py"]
    assert mutmut["pytest_add_cli_args_test_selection"] == list(script.GROUPS["scheduler"].tests)
    assert mutmut["process_isolation"] == original["tool"]["mutmut"]["process_isolation"]
