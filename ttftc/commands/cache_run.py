"""`ttftc cache` run: what the parsed arguments of ttftc/commands/cache.py do."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ttftc.commands import UsageError
from ttftc.runtime.kv_disk import clear_directory, directory_usage


def run(args: argparse.Namespace) -> int:
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
