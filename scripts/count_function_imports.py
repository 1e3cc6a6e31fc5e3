"""Count the imports that sit inside a function or method body in a package (ttftc/ by default).

An import inside a function is a dependency a reader of the module's header does not see (lint-imports still
counts it, see .importlinter), and it is often how an import cycle was dodged; this lists each one so that the
count can only go down.

    python3 scripts/count_function_imports.py [ROOT] [--quiet]

Prints one line per import (path:line  function  the imported module), then the total. Exit status 0.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def _imported(node: ast.Import | ast.ImportFrom) -> str:
    if isinstance(node, ast.Import):
        return ", ".join(alias.name for alias in node.names)
    module = "." * node.level + (node.module or "")
    return f"{module}: " + ", ".join(alias.name for alias in node.names)


def function_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, enclosing function, what is imported) for every import inside a function body of one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name if function is None else f"{function}.{child.name}")
            elif isinstance(child, ast.Lambda):
                visit(child, function or "<lambda>")
            elif isinstance(child, (ast.Import, ast.ImportFrom)) and function is not None:
                found.append((child.lineno, function, _imported(child)))
            else:
                visit(child, function)

    visit(tree, None)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="ttftc", help="a package directory (default: ttftc)")
    parser.add_argument("--quiet", action="store_true", help="print only the total")
    args = parser.parse_args(argv)
    root = Path(args.root)
    total = 0
    for path in sorted(root.rglob("*.py")):
        for line, function, what in function_imports(path):
            total += 1
            if not args.quiet:
                print(f"{path}:{line}\t{function}\t{what}")
    print(f"{total} imports inside functions under {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
