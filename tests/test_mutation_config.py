"""scripts/mutation.py and the [tool.mutmut] table of pyproject.toml describe the same modules and test files, and
every path they name exists (a renamed test file would otherwise leave its modules without killers)."""

from __future__ import annotations

import glob
import importlib.util
import json
import sys
import tomllib
from pathlib import Path

import pytest

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


def _fake_scratch_copy(root: Path, module: str, exit_codes: dict, hashes: dict) -> None:
    meta = root / "mutants" / (module + ".meta")
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"exit_code_by_key": exit_codes, "hash_by_function_name": hashes,
                                "type_check_error_by_key": {}, "durations_by_key": {"x": 1.0},
                                "estimated_durations_by_key": {}}))


def test_results_go_through_the_ledger_into_a_new_scratch_copy(tmp_path, monkeypatch):
    script = _script()
    monkeypatch.setattr(script, "LEDGER_DIR", tmp_path / "ledger")
    monkeypatch.setenv("TTFTC_MUTATION_DIR", str(tmp_path / "old-machine"))
    codes = {"ttftc.buckets.table.x_bucket_for__mutmut_1": 1, "ttftc.buckets.table.x_bucket_for__mutmut_2": 0,
             "ttftc.buckets.table.x_bucket_for__mutmut_3": None}
    _fake_scratch_copy(tmp_path / "old-machine" / "g", "ttftc/buckets/table.py", codes, {"x_bucket_for": "abc"})
    saved = script.save_ledger("g")
    assert json.loads(saved.read_text())["ttftc/buckets/table.py"]["exit_code_by_mutant"] == {
        "x_bucket_for__mutmut_1": 1, "x_bucket_for__mutmut_2": 0, "x_bucket_for__mutmut_3": None}

    monkeypatch.setenv("TTFTC_MUTATION_DIR", str(tmp_path / "new-machine"))
    assert script.results("g") == {"ttftc/buckets/table.py": {  # before any run here: the committed results
        "ttftc.buckets.table.x_bucket_for__mutmut_1": "killed", "ttftc.buckets.table.x_bucket_for__mutmut_2": "survived",
        "ttftc.buckets.table.x_bucket_for__mutmut_3": "not checked"}}
    mutants = tmp_path / "new-machine" / "g" / "mutants"
    script.seed_from_ledger("g", mutants)
    seeded = json.loads((mutants / "ttftc/buckets/table.py.meta").read_text())
    assert seeded["exit_code_by_key"] == codes and seeded["hash_by_function_name"] == {"x_bucket_for": "abc"}
    # the keys mutmut's loader pops, and no other (it asserts that none is left)
    assert set(seeded) == {"exit_code_by_key", "hash_by_function_name", "type_check_error_by_key",
                           "durations_by_key", "estimated_durations_by_key"}


@pytest.mark.parametrize("module, entry", [
    ("../outside.py", {"hash_by_function_name": {}, "exit_code_by_mutant": {}}),
    ("/etc/x.py", {"hash_by_function_name": {}, "exit_code_by_mutant": {}}),
    ("ttftc/../../x.py", {"hash_by_function_name": {}, "exit_code_by_mutant": {}}),
    ("ttftc/buckets/table.txt", {"hash_by_function_name": {}, "exit_code_by_mutant": {}}),
    ("ttftc/buckets/table.py", {"hash_by_function_name": {}, "exit_code_by_mutant": {"m": "os.system"}}),
    ("ttftc/buckets/table.py", {"hash_by_function_name": {"f": 1}, "exit_code_by_mutant": {}}),
    ("ttftc/buckets/table.py", {"hash_by_function_name": {}, "exit_code_by_mutant": {}, "extra": 1}),
    ("ttftc/buckets/table.py", []),
])
def test_a_malformed_ledger_is_refused_naming_the_entry_and_the_fix(tmp_path, monkeypatch, module, entry):
    script = _script()
    monkeypatch.setattr(script, "LEDGER_DIR", tmp_path)
    (tmp_path / "g.json").write_text(json.dumps({module: entry}))
    with pytest.raises(SystemExit, match=r"malformed; delete it"):
        script.seed_from_ledger("g", tmp_path / "mutants")
    assert not (tmp_path / "mutants").exists()


def test_a_ledger_that_is_not_json_is_refused(tmp_path, monkeypatch):
    script = _script()
    monkeypatch.setattr(script, "LEDGER_DIR", tmp_path)
    (tmp_path / "g.json").write_text('{"ttftc/a.py": ')
    with pytest.raises(SystemExit, match="not valid JSON"):
        script.load_ledger("g")


_DECORATED = '''
import functools

calls = []


def tag(label):
    def apply(function):
        calls.append((label, function.__name__))
        function.tags = getattr(function, "tags", ()) + (label,)
        return function
    return apply


# a comment above the decorators stays above the function
@tag("outer")
@tag("inner")
def tagged(x):
    return x + 1


@functools.cache
def cached(x):
    return [x]


class Box:
    def __init__(self, value):
        self._value = value

    @property
    def value(self):
        return self._value

    @value.setter
    def value(self, new):
        self._value = new

    @staticmethod
    def static(x):
        return x * 2


@triton.jit
def kernel(x):
    return x
'''


def test_the_scratch_copy_applies_decorators_by_assignment_so_mutmut_mutates_the_functions():
    script = _script()
    source = _DECORATED.replace("@triton.jit", "@tag('jit')")  # exec has no triton; the rename is checked below
    rewritten = script.undecorated(source)
    assert "@tag(\"outer\")" not in rewritten and "@functools.cache" not in rewritten and "    @property" not in rewritten
    assert 'tagged = tag("outer")(tag("inner")(tagged))' in rewritten
    assert "cached = functools.cache(cached)" in rewritten and "    value = property(value)" in rewritten
    assert "# a comment above the decorators stays above the function\ndef tagged(x):" in rewritten
    assert "    @value.setter" in rewritten and "    @staticmethod" in rewritten  # these keep their decorators
    assert "@triton.jit\ndef kernel(x):" in script.undecorated(_DECORATED)  # Triton compiles its source text
    original, plain = {}, {}
    exec(source, original)
    exec(rewritten, plain)
    for namespace in (original, plain):
        assert namespace["calls"] == [("inner", "tagged"), ("outer", "tagged"), ("jit", "kernel")]
        assert namespace["tagged"](1) == 2 and namespace["tagged"].tags == ("inner", "outer")
        assert namespace["cached"](3) is namespace["cached"](3)
        box = namespace["Box"](5)
        box.value = 7
        assert box.value == 7 and namespace["Box"].static(2) == 4
    assert script.undecorated(rewritten) == rewritten  # nothing decorated is left to rewrite
