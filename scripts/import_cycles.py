"""Find import cycles in a package, between modules and between its top-level packages.

Imports inside functions count like any other (grimp reads every import statement), because a cycle dodged by
moving one import into a function is still a cycle to whoever reads or changes the code. Top-level packages are
the package's direct children: ttftc.codegen, ttftc.runtime, ttftc.config, and so on.

    PYTHONPATH=. python3 scripts/import_cycles.py [PACKAGE]

Prints each cycle (its members, then one import that closes it per pair) and exits 1 when there is one, else 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping

import grimp


def strongly_connected(nodes: Iterable[str], edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The groups of more than one node that reach each other (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges.get(successor, ())))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def top_level(module: str, package: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == package and len(parts) > 1 else module


def cycles(package: str) -> tuple[list[list[str]], list[list[str]], list[tuple[str, str]]]:
    """(module cycles, top-level package cycles, the module imports that run between members of a package cycle)."""
    graph = grimp.build_graph(package)
    module_edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    module_cycles = strongly_connected(module_edges, module_edges)
    package_edges: dict[str, set[str]] = {}
    for importer, imported in ((a, b) for a, bs in module_edges.items() for b in bs):
        a, b = top_level(importer, package), top_level(imported, package)
        if a != b:
            package_edges.setdefault(a, set()).add(b)
    packages = {top_level(m, package) for m in graph.modules}
    package_cycles = strongly_connected(packages, package_edges)
    in_cycle = {p: i for i, group in enumerate(package_cycles) for p in group}
    closing = sorted(
        (a, b) for a, bs in module_edges.items() for b in bs
        if (pa := top_level(a, package)) != (pb := top_level(b, package))
        and pa in in_cycle and in_cycle.get(pb) == in_cycle[pa]
    )
    return module_cycles, package_cycles, closing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="ttftc")
    args = parser.parse_args(argv)
    module_cycles, package_cycles, closing = cycles(args.package)
    for group in module_cycles:
        print("module cycle: " + " <-> ".join(group))
    for group in package_cycles:
        print("package cycle: " + " <-> ".join(group))
    for importer, imported in closing:
        print(f"  {importer} -> {imported}")
    print(f"{len(module_cycles)} module cycles, {len(package_cycles)} package cycles in {args.package}")
    return 1 if module_cycles or package_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
