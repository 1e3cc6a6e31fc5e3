"""`ttftc cache list|clear DIR`: the prefix cache's disk tier (`ttftc serve --kv-disk DIR`) as its operator sees it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cache", help="list or clear the prefix cache's disk tier (ttftc serve --kv-disk DIR)",
                              description=__doc__)
    p.add_argument("action", choices=("list", "clear"), help="list: blocks and bytes; clear: delete every block")
    p.add_argument("directory", metavar="DIR", help="the --kv-disk directory")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ttftc.commands import UsageError
    from ttftc.runtime.kv_disk import clear_directory, directory_usage

    directory = Path(args.directory)
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory; give the directory that `ttftc serve --kv-disk` was given")
    if args.action == "clear":
        print(f"removed {clear_directory(directory)} KV blocks from {directory}")
        return 0
    blocks, nbytes = directory_usage(directory)
    if args.json:
        print(json.dumps({"directory": str(directory), "blocks": blocks, "bytes": nbytes}))
    else:
        print(f"{directory}: {blocks} KV blocks, {nbytes / 2**20:.1f} MiB")
    return 0
