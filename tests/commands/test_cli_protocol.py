"""The CLI's protocol (ttftc/cli.py): parsing loads only the light parser modules; each subcommand names a run
module that exists and has run(args)."""

import argparse
import importlib
import subprocess
import sys

from ttftc import cli


def test_parsing_imports_no_torch_and_no_run_module():
    probe = ("import sys; from ttftc import cli; cli.build_parser().parse_args(['cache', 'list', '.']); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
             "or m.endswith('_run')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_subcommand_names_a_run_module_with_run():
    parser = cli.build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(subparsers.choices) == [m.__name__.rsplit(".", 1)[1] for m in cli.SUBCOMMANDS]
    for name, sub in subparsers.choices.items():
        module_name = sub.get_default("run_module")
        assert module_name == f"ttftc.commands.{name}_run", name
        assert callable(importlib.import_module(module_name).run), name
