"""Count the imports that sit inside a function or method body in a package (ttftc/ by default).

An import inside a function is a dependency a reader of the module's header does not see (lint-imports still
counts it, see .importlinter), and it is often how an import cycle was dodged; this lists each one so that the
count can only go down.

An import may stay inside a function only for a stated reason (an optional dependency, or a cost deferred by
design), written at the end of its first line as `# lazy: <reason>`.

    python3 scripts/count_function_imports.py [ROOT] [--quiet] [--check BUDGET]

Prints one line per import (path:line  function  the imported module  reason), then the total. With --check, the
exit status is 1 when the total reaches BUDGET or an import has no `# lazy:` reason, else 0.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

REASON = re.compile(r"#\s*lazy:\s*(\S.*)$")


def _imported(node: ast.Import | ast.ImportFrom) -> str:
    if isinstance(node, ast.Import):
        return ", ".join(alias.name for alias in node.names)
    module = "." * node.level + (node.module or "")
    return f"{module}: " + ", ".join(alias.name for alias in node.names)


def function_imports(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, enclosing function, what is imported, the `# lazy:` reason or "") for every import inside a function
    body of one file."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source, filename=str(path))
    found: list[tuple[int, str, str, str]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name if function is None else f"{function}.{child.name}")
            elif isinstance(child, ast.Lambda):
                visit(child, function or "<lambda>")
            elif isinstance(child, (ast.Import, ast.ImportFrom)) and function is not None:
                reason = REASON.search(lines[child.lineno - 1])
                found.append((child.lineno, function, _imported(child), reason.group(1).strip() if reason else ""))
            else:
                visit(child, function)

    visit(tree, None)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="ttftc", help="a package directory (default: ttftc)")
    parser.add_argument("--quiet", action="store_true", help="print only the total")
    parser.add_argument("--check", type=int, metavar="BUDGET",
                        help="fail unless there are fewer than BUDGET, each with a `# lazy:` reason")
    args = parser.parse_args(argv)
    root = Path(args.root)
    total = 0
    unexplained = []
    for path in sorted(root.rglob("*.py")):
        for line, function, what, reason in function_imports(path):
            total += 1
            if not reason:
                unexplained.append(f"{path}:{line}")
            if not args.quiet:
                print(f"{path}:{line}\t{function}\t{what}\t{reason or '(no # lazy: reason)'}")
    print(f"{total} imports inside functions under {root}, {len(unexplained)} without a `# lazy:` reason")
    if args.check is None:
        return 0
    failed = total >= args.check or bool(unexplained)
    if failed:
        print(f"FAILED: the budget is fewer than {args.check}, each with a reason at the end of its line as "
              "`# lazy: <reason>`; move the others to the top of their module", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
