"""`ttftc cache list|clear DIR`: the prefix cache's disk tier (`ttftc serve --kv-disk DIR`) as its operator sees it."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cache", help="list or clear the prefix cache's disk tier (ttftc serve --kv-disk DIR)",
                              description=__doc__)
    p.add_argument("action", choices=("list", "clear"), help="list: blocks and bytes; clear: delete every block")
    p.add_argument("directory", metavar="DIR", help="the --kv-disk directory")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.set_defaults(run_module="ttftc.commands.cache_run")
