"""The `ttftc` command: a thin dispatcher over one pair of modules per subcommand.

    ttftc bench MODEL --seq 128,512 --json out.json --md out.md --plot out.png
    ttftc explain MODEL --seq 128 --precision bf16

A subcommand NAME is two modules in ttftc/commands/:

    NAME.py      def add_parser(subparsers) -> None: subparsers.add_parser("NAME", help=...), its arguments, and
                 set_defaults(run_module="ttftc.commands.NAME_run"). Standard library imports only (and other
                 parser modules, ttftc.config), so `ttftc --help` and argument errors stay quick.
    NAME_run.py  def run(args) -> int: the exit status; raise ttftc.commands.UsageError for bad input. Imports
                 what it needs at its top (torch, the model code, the server).

and one entry in SUBCOMMANDS below. main imports only the chosen subcommand's run module.
Bad input gives one line on stderr and exit status 2, from argparse and from UsageError alike.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

from ttftc.commands import UsageError, autotune, bench, cache, explain, kernels, loadtest, serve
from ttftc.commands import compile as compile_command  # not the builtin

# In the order `ttftc --help` lists them.
SUBCOMMANDS = (autotune, bench, compile_command, explain, serve, loadtest, cache, kernels)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but an error is a single line (no usage block), still with exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="ttftc", description="ttftc: a torch.compile backend for time to first token.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    subparsers.required = True
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # The lazy boundary of the CLI: only the chosen subcommand's run module (and so torch, the model code or
        # the server) is imported, once the arguments parsed.
        run_module = importlib.import_module(args.run_module)
        return int(run_module.run(args) or 0)
    except UsageError as exc:
        message = " ".join(str(exc).split())
        print(f"ttftc {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ttftc {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
