"""The `ttftc` command: a thin dispatcher over one module per subcommand.

    ttftc bench MODEL --seq 128,512 --json out.json --md out.md --plot out.png
    ttftc explain MODEL --seq 128 --precision bf16

A subcommand is a module in ttftc/commands/ with two functions:

    def add_parser(subparsers) -> None:    # subparsers.add_parser("name", help=...), then its arguments
    def run(args) -> int:                  # the exit status; raise ttftc.commands.UsageError for bad input

and one line in SUBCOMMANDS below. Keep heavy imports inside `run`, so `ttftc --help` stays quick.
Bad input gives one line on stderr and exit status 2, from argparse and from UsageError alike.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

# One line per subcommand, in the order `ttftc --help` lists them.
SUBCOMMANDS = (
    "ttftc.commands.autotune",
    "ttftc.commands.bench",
    "ttftc.commands.compile",
    "ttftc.commands.explain",
    "ttftc.commands.serve",
    "ttftc.commands.loadtest",
    "ttftc.commands.cache",
    "ttftc.commands.kernels",
)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but an error is a single line (no usage block), still with exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="ttftc", description="ttftc: a torch.compile backend for time to first token.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    subparsers.required = True
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    from ttftc.commands import UsageError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except UsageError as exc:
        message = " ".join(str(exc).split())
        print(f"ttftc {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ttftc {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
