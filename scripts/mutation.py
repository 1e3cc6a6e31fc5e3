"""Mutation testing (mutmut 3) of the modules where a silent numeric or scheduling bug costs most. Not part of CI.

    python3 scripts/mutation.py                      # every group, one after another
    python3 scripts/mutation.py scheduler buckets-plan   # some groups
    python3 scripts/mutation.py --list               # the groups, their modules and test files
    python3 scripts/mutation.py --report             # the score table of the runs so far, without running
    python3 scripts/mutation.py --save cpu-kernels   # write a run's results so far to scripts/mutation_results/
    python3 scripts/mutation.py --retest-survivors scheduler   # after adding tests: retry the survivors only
    python3 scripts/mutation.py --retest-timeouts scheduler    # retry timeouts (a paused machine causes some)

Each group mutates its modules and runs only its matching test files (the quick ones: `-m "not slow"`), so a
mutant is judged by the tests written for its module, not by whole-model tests that happen to execute it.
mutmut runs in a scratch copy of the repository (TTFTC_MUTATION_DIR, default /tmp/ttftc-mutation/<group>), never
in the checkout; a second run resumes there and only tries mutants without a result (--fresh starts over).
Each run ends by writing the group's results into scripts/mutation_results/<group>.json, to be committed: a new
machine's scratch copy starts from them, and mutmut runs again only the mutants of functions edited since.
Workers: TTFTC_MUTATION_JOBS (default 1; the machine is shared).

The [tool.mutmut] section of pyproject.toml holds the shared settings and, in only_mutate and
pytest_add_cli_args_test_selection, the union of the groups below (tests/test_mutation_config.py checks that).

Score per module: (killed + timeout + crash) / (mutants - equivalent - unrun); the other columns leave the equivalent
mutants out. A mutant is equivalent when no test can tell it from the original (the same behaviour by another
route); scripts/mutation_equivalent.toml lists each such mutant with the reason, and the report flags entries that no
longer match a surviving mutant.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import libcst as cst  # mutmut's own parser, installed with it

REPO = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = REPO / "scripts" / "mutation_equivalent.toml"
# Each group's results, committed: mutmut keeps its own in the scratch copy (/tmp), which a new machine does not have.
LEDGER_DIR = REPO / "scripts" / "mutation_results"
_COPY_IGNORE = shutil.ignore_patterns(".git", "mutants", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info",
                                      "out*", ".benchmarks")


@dataclass(frozen=True)
class Group:
    modules: tuple[str, ...]  # only_mutate globs, relative to the repository
    tests: tuple[str, ...]  # the test files that are meant to catch a bug in those modules


GROUPS: dict[str, Group] = {
    "cpu-kernels": Group(
        ("ttftc/codegen/cpu/*.py",),
        ("tests/codegen/test_attention_cpu.py", "tests/codegen/test_linear_cpu.py", "tests/codegen/test_ffn_cpu.py",
         "tests/codegen/test_norm_linear_cpu.py", "tests/codegen/test_int8_cpu.py", "tests/codegen/test_rope_cpu.py",
         "tests/codegen/test_allocator_cpu.py", "tests/codegen/test_attention_native_cpu.py",
         "tests/codegen/test_attention_gemm_blocks_cpu.py", "tests/codegen/test_rows_native_cpu.py",
         "tests/codegen/test_int8_onednn_cpu.py", "tests/autotune/test_cpu_threads.py"),
    ),
    "triton-attention": Group(
        ("ttftc/codegen/triton/attention.py",),
        ("tests/codegen/test_attention_triton.py", "tests/autotune/test_triton_attention_tuning.py"),
    ),
    "precision": Group(
        ("ttftc/passes/precision.py", "ttftc/passes/_bf16_rewrite.py", "ttftc/passes/_w8a8_rewrite.py",
         "ttftc/passes/_quant_patterns.py", "ttftc/passes/_module_names.py", "ttftc/passes/_precision_common.py"),
        # Not test_precision.py or test_precision_policy.py: they compile zoo models (far too slow per mutant).
        ("tests/passes/test_precision_rewrites.py",),
    ),
    "attention-mask": Group(
        ("ttftc/passes/_attention_mask.py",),
        ("tests/passes/test_attention_mask.py",),
    ),
    # Two groups, so that a plan.py mutant is judged by the plan's own tests in seconds, not by every bucketed-model
    # test that reaches it (each of those compiles models).
    "buckets-plan": Group(
        ("ttftc/buckets/plan.py", "ttftc/buckets/program.py", "ttftc/buckets/table.py", "ttftc/buckets/constants.py"),
        ("tests/buckets/test_plan.py", "tests/buckets/test_program.py"),
    ),
    "buckets-model": Group(
        ("ttftc/buckets/capture.py", "ttftc/buckets/compiled.py"),
        # test_plan.py: capture.py's analysis front end (adapter, example inputs, analyse_padding's refusals).
        ("tests/test_bucketed.py", "tests/buckets/test_plan.py"),
    ),
    "scheduler": Group(
        ("ttftc/runtime/scheduler.py",),
        ("tests/runtime/test_scheduler_logic.py", "tests/runtime/test_sessions_and_scheduler.py"),
    ),
    "prefix-cache": Group(
        ("ttftc/runtime/prefix_cache.py",),
        ("tests/runtime/test_prefix_cache.py",),
    ),
    "graph-format": Group(
        ("ttftc/cache/graph_format.py",),
        ("tests/cache/test_graph_format.py",),
    ),
}


def shared_settings() -> dict:
    """[tool.mutmut] of pyproject.toml, without the two lists each group sets for itself."""
    settings = dict(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mutmut"])
    settings.pop("only_mutate", None)
    settings.pop("pytest_add_cli_args_test_selection", None)
    return settings


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


def group_config(group: Group) -> str:
    settings = {**shared_settings(), "only_mutate": list(group.modules),
                "pytest_add_cli_args_test_selection": list(group.tests)}
    return "[tool.mutmut]\n" + "".join(f"{key} = {_toml_value(value)}\n" for key, value in settings.items())


def _with_group_config(pyproject: str, group: Group) -> str:
    """pyproject.toml text with its [tool.mutmut] table replaced by the group's."""
    lines, out, skipping = pyproject.splitlines(keepends=True), [], False
    for line in lines:
        if line.strip().startswith("["):
            skipping = line.strip() == "[tool.mutmut]"
        if not skipping:
            out.append(line)
    return "".join(out).rstrip("\n") + "\n\n" + group_config(group)


def workdir(name: str) -> Path:
    return Path(os.environ.get("TTFTC_MUTATION_DIR", "/tmp/ttftc-mutation")) / name


def prepare(name: str, fresh: bool) -> Path:
    """The group's scratch copy of the repository, refreshed from the checkout (mutmut's results are kept)."""
    root = workdir(name)
    if fresh and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if _COPY_IGNORE(str(REPO), [entry.name]):
            continue
        target = root / entry.name
        if entry.is_dir():
            shutil.copytree(entry, target, ignore=_COPY_IGNORE, dirs_exist_ok=True)
        else:
            shutil.copy2(entry, target)
    pyproject = root / "pyproject.toml"
    pyproject.write_text(_with_group_config(pyproject.read_text(), GROUPS[name]))
    for pattern in GROUPS[name].modules:  # rewritten each time, so mutmut makes their mutants again (results stay)
        for module in root.glob(pattern):
            module.write_text(undecorated(module.read_text()))
    # mutmut refreshes only the .py files of its own copy (mutants/): the native extension and its C++ sources there
    # would stay as at the first run, and a rebuilt extension's Python side would call a stale binary.
    if (root / "mutants").is_dir():
        for path in (REPO / "ttftc").rglob("*"):
            if path.is_file() and path.suffix not in (".py", ".pyc"):
                target = root / "mutants" / path.relative_to(REPO)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    if not fresh:
        seed_from_ledger(name, root / "mutants")
    return root


# -- decorated functions --------------------------------------------------------------------------------------
# mutmut leaves every decorated function unmutated (only a lone @staticmethod or @classmethod passes), and the
# lowerings (@register_lowering), the cached capability probes (@functools.cache) and properties are decorated. The
# scratch copy applies such decorators by assignment after the def instead, which binds the same object to the same
# name, so mutmut mutates their bodies too.


def _decorator_name(decorator: cst.Decorator) -> str:
    expression = decorator.decorator
    if isinstance(expression, cst.Call):
        expression = expression.func
    parts = []
    while isinstance(expression, cst.Attribute):
        parts.append(expression.attr.value)
        expression = expression.value
    if isinstance(expression, cst.Name):
        parts.append(expression.value)
    return ".".join(reversed(parts))


def _keeps_its_decorators(function: cst.FunctionDef) -> bool:
    names = [_decorator_name(d) for d in function.decorators]
    return (not names
            or names in (["staticmethod"], ["classmethod"])  # mutmut mutates these itself
            or any(n.endswith("jit") for n in names)  # triton.jit compiles the function's own source text
            # @name.setter needs `name` to be the property still; after the def, it is the bare function
            or any(n.split(".")[0] == function.name.value for n in names))


def _undecorated_body(statements) -> list:
    out = []
    for statement in statements:
        if isinstance(statement, cst.ClassDef):
            statement = statement.with_changes(body=statement.body.with_changes(
                body=_undecorated_body(statement.body.body)))
        if not isinstance(statement, cst.FunctionDef) or _keeps_its_decorators(statement):
            out.append(statement)
            continue
        applied: cst.BaseExpression = statement.name
        for decorator in reversed(statement.decorators):  # the innermost decorator is applied first
            applied = cst.Call(func=decorator.decorator, args=[cst.Arg(applied)])
        comments_above = statement.decorators[0].leading_lines
        out.append(statement.with_changes(decorators=[], leading_lines=[*comments_above, *statement.leading_lines]))
        out.append(cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(statement.name)],
                                                            value=applied)]))
    return out


def undecorated(source: str) -> str:
    """`source` with each decorated module-level function and method (but those in _keeps_its_decorators) written
    as a plain def followed by `name = decorator(name)`: the same object under the same name."""
    module = cst.parse_module(source)
    return module.with_changes(body=_undecorated_body(module.body)).code


def _call(command: list[str], cwd: Path, env: dict, minutes: Optional[float]) -> int:
    """Run mutmut; after `minutes`, interrupt it the way Ctrl-C does (it keeps every result it has)."""
    process = subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True)
    try:
        return process.wait(timeout=None if minutes is None else minutes * 60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        print(f"stopped after {minutes} minutes; run again to go on", flush=True)
        return 0


def run_group(name: str, jobs: int, fresh: bool, retest_survivors: bool, minutes: Optional[float] = None,
              retest_timeouts: bool = False) -> int:
    root = prepare(name, fresh)
    mutmut = shutil.which("mutmut") or str(Path(sys.executable).with_name("mutmut"))
    # PYTHONPATH: the copy, not the checkout, is what the tests import. OMP_NUM_THREADS=1: mutmut forks each mutant
    # from a server that collected the tests; a test module whose import ran a parallel op (torch.tril of a 16x16
    # constant) left an OpenMP team there, and every child that ran a parallel op waited on it until its timeout.
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    # mutmut keeps a result until the mutated function changes; after new tests, name the survivors to retry them
    # (with the mutants that no test reached: the new tests may reach them). A timeout can be the machine's doing:
    # besides its CPU-time limit, mutmut stops a mutant after (estimated time + timeout_constant) x
    # timeout_multiplier of wall time, which a paused or starved run exceeds; --retest-timeouts runs those again.
    retry = ({"survived", "no tests"} if retest_survivors else set()) | ({"timeout"} if retest_timeouts else set())
    # A listed equivalent survives any test by its reason, and retrying one costs every test that reaches it.
    equivalent = equivalent_mutants()
    again = [m for statuses in results(name).values() for m, s in statuses.items()
             if s in retry and m not in equivalent]
    print(f"== {name}: mutmut in {root}" + (f", retrying {len(again)} mutants ({', '.join(sorted(retry))}; not "
                                            f"the listed equivalents)"
                                            if again else ""), flush=True)
    if retry and not again:
        return 0
    code = _call([mutmut, "run", "--max-children", str(jobs), *again], root, env, minutes)
    saved = save_ledger(name)
    if saved:
        print(f"results saved in {saved.relative_to(REPO)} (commit it: a new scratch copy starts from it)", flush=True)
    return code


# -- the ledger: results that outlive the scratch copy ----------------------------------------------------------


def ledger_path(name: str) -> Path:
    return LEDGER_DIR / f"{name}.json"


def save_ledger(name: str) -> Optional[Path]:
    """Write the group's mutmut results (per module: function hashes, exit code per mutant) into the checkout."""
    modules = {module: {"hash_by_function_name": data["hash_by_function_name"],
                        "exit_code_by_mutant": {key.removeprefix(_module_prefix(module)): code
                                                for key, code in data["exit_code_by_key"].items()}}
               for module, data in _scratch_results(name).items()}
    if not modules:
        return None
    path = ledger_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(modules, indent=1, sort_keys=True) + "\n")
    return path


def _scratch_results(name: str) -> dict[str, dict]:
    """module path -> mutmut's metadata of it, for the modules with mutants, from the group's scratch copy."""
    mutants = workdir(name) / "mutants"
    found = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        if data["exit_code_by_key"]:
            found[str(meta.relative_to(mutants))[: -len(".meta")]] = data
    return found


def _module_prefix(module: str) -> str:
    """mutmut's name prefix of a module's mutants: ttftc/buckets/plan.py -> ttftc.buckets.plan."""
    return module[: -len(".py")].replace("/", ".") + "."


def load_ledger(name: str) -> dict[str, dict]:
    """module -> {"hash_by_function_name", "exit_code_by_key"}, checked: the file is data from the repository, and a
    module path must name a Python file of the package (no other path is written from it)."""
    path = ledger_path(name)
    if not path.exists():
        return {}
    try:
        modules = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise SystemExit(f"{path} is not valid JSON ({error}); delete it to start the group's results over")
    if not isinstance(modules, dict):
        raise SystemExit(f"{path}: expected an object of modules; delete it to start the group's results over")
    checked = {}
    for module, entry in modules.items():
        if not _well_formed(module, entry):
            raise SystemExit(f"{path}: entry {module!r} is malformed; delete it to start the group's results over")
        prefix = _module_prefix(module)
        checked[module] = {"hash_by_function_name": dict(entry["hash_by_function_name"]),
                           "exit_code_by_key": {prefix + k: v for k, v in entry["exit_code_by_mutant"].items()}}
    return checked


def _well_formed(module, entry) -> bool:
    if not (isinstance(module, str) and module.endswith(".py") and not Path(module).is_absolute()
            and Path(module).parts[:1] == ("ttftc",) and ".." not in Path(module).parts):
        return False
    if not (isinstance(entry, dict) and set(entry) == {"hash_by_function_name", "exit_code_by_mutant"}):
        return False
    hashes, codes = entry["hash_by_function_name"], entry["exit_code_by_mutant"]
    return (isinstance(hashes, dict) and isinstance(codes, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in hashes.items())
            and all(isinstance(k, str) and (v is None or type(v) is int) for k, v in codes.items()))


def seed_from_ledger(name: str, mutants: Path) -> None:
    """Give a new scratch copy the committed results. mutmut keeps a result while its function's hash is unchanged,
    so only mutants of functions edited since are run again."""
    for module, entry in load_ledger(name).items():
        meta = mutants / (module + ".meta")
        if meta.exists():  # the scratch copy's own results are at least as new
            continue
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({**entry, "type_check_error_by_key": {}, "durations_by_key": {},
                                    "estimated_durations_by_key": {}}))


# -- the report ----------------------------------------------------------------------------------------------


def _status(exit_code) -> str:
    from mutmut.stats import status_by_exit_code

    status = status_by_exit_code[exit_code]
    # Killed by a signal mutmut has no name for (SIGFPE from a kernel fed an empty tensor, SIGABRT): the tests did
    # not pass, so the mutant is detected.
    if status == "suspicious" and isinstance(exit_code, int) and exit_code < 0:
        return "crashed"
    return status


def results(name: str) -> dict[str, dict[str, str]]:
    """module path -> mutant name -> status, from the group's mutmut metadata."""
    # the scratch copy's results; on a machine without one, the committed results
    modules = _scratch_results(name) or {module: entry for module, entry in sorted(load_ledger(name).items())
                                         if entry["exit_code_by_key"]}
    return {module: {mutant: _status(code) for mutant, code in data["exit_code_by_key"].items()}
            for module, data in modules.items()}


def equivalent_mutants() -> dict[str, str]:
    """mutant name -> why it is equivalent."""
    if not EQUIVALENT_FILE.exists():
        return {}
    return {name: entry["reason"] for name, entry in tomllib.loads(EQUIVALENT_FILE.read_text()).items()}


def report(names) -> int:
    equivalent = equivalent_mutants()
    seen: set[str] = set()
    below = 0
    header = (f"{'module':44} {'mutants':>7} {'killed':>6} {'timeout':>7} {'crash':>5} {'survived':>8} "
              f"{'no test':>7} {'equiv':>5} {'unrun':>5} {'score':>6}")
    print(header)
    for name in names:
        for module, statuses in results(name).items():
            # A listed mutant that a test kills is not equivalent: it counts as killed (and is reported as stale).
            equivalents = {m for m, s in statuses.items() if m in equivalent and s != "killed"}
            seen.update(equivalents)
            counts = Counter(s for m, s in statuses.items() if m not in equivalents)
            crashed = counts["crashed"] + counts["segfault"]
            detected = counts["killed"] + counts["timeout"] + crashed + counts["caught by type check"]
            unrun = counts["not checked"]
            judged = len(statuses) - len(equivalents) - unrun
            score = detected / judged if judged else 1.0
            below += score < 0.85 or unrun > 0
            print(f"{module:44} {len(statuses):7} {counts['killed']:6} {counts['timeout']:7} {crashed:5} "
                  f"{counts['survived']:8} {counts['no tests']:7} {len(equivalents):5} {unrun:5} {score:6.1%}")
            undecided = sorted(m for m, s in statuses.items()
                               if s not in ("killed", "timeout", "crashed", "segfault", "not checked")
                               and m not in equivalents)
            for mutant in undecided:
                print(f"    {statuses[mutant]:10} {mutant}")
    # Only the modules these groups' runs mutated: another group's entries are not stale for not being seen here.
    prefixes = tuple(module[: -len(".py")].replace("/", ".") + "." for name in names for module in results(name))
    stale = sorted(m for m in set(equivalent) - seen if m.startswith(prefixes))
    if stale:
        print("listed as equivalent but not a surviving mutant of these runs (killed, renamed or not run):")
        for mutant in stale:
            print(f"    {mutant}")
    return 1 if below else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="*", metavar="GROUP", help=f"one of {', '.join(GROUPS)} (default: all)")
    parser.add_argument("--list", action="store_true", help="print the groups and exit")
    parser.add_argument("--report", action="store_true", help="print the scores of earlier runs and exit")
    parser.add_argument("--save", action="store_true",
                        help="write the scratch copies' results (a running one's too) to the committed files and exit")
    parser.add_argument("--fresh", action="store_true",
                        help="drop earlier results of these groups first (the scratch copy's and the committed ones)")
    parser.add_argument("--retest-survivors", action="store_true",
                        help="run the surviving mutants of earlier runs again (after adding tests), except the "
                             "listed equivalents")
    parser.add_argument("--retest-timeouts", action="store_true",
                        help="run the mutants that timed out again (a paused or busy machine can time a run out)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="stop each group's run after this long (its results are kept; run again to go on)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.groups) - set(GROUPS))
    if unknown:
        parser.error(f"unknown group(s) {unknown}; the groups are {', '.join(GROUPS)}")
    names = args.groups or list(GROUPS)
    if args.list:
        for name in names:
            print(f"{name}: {' '.join(GROUPS[name].modules)}\n    tests: {' '.join(GROUPS[name].tests)}")
        return 0
    if args.save:
        for name in names:
            saved = save_ledger(name)
            print(f"{name}: " + (f"saved in {saved.relative_to(REPO)}" if saved else "no results to save"))
        return 0
    if not args.report:
        jobs = int(os.environ.get("TTFTC_MUTATION_JOBS", "1"))
        for name in names:
            if run_group(name, jobs, args.fresh, args.retest_survivors, args.minutes, args.retest_timeouts) != 0:
                print(f"mutmut failed for group {name}", file=sys.stderr)
    return report(names)


if __name__ == "__main__":
    sys.exit(main())
