"""Report the house's shape from the source: lines per folder, the longest functions, and the import circles.

Run from the repository root (``python scripts/house_report.py``). Folders are the top-level source folders of the
``vllite`` package and their first-level subfolders; an import circle is a strongly connected component of the graph
of ``vllite`` modules in which an edge is any import, at module level or inside a function (a function-level import
still ties the two modules together for a reader). Used for the before/after figures of restructuring work.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package name it is imported as (see ``package-dir`` in pyproject.toml).
PACKAGES = {
    "core": "vllite",
    "plugins": "vllite.plugins",
    "schedulers": "vllite.policies",
    "builtin_logitsprocs": "vllite.builtin_logitsprocs",
    "vllite_kernels": "vllite.kernels",
    "vllite_testing": "vllite.testing",
    "vllite_platform": "vllite.platform",
}


def source_files() -> Iterator[tuple[str, Path]]:
    """``(module name, path)`` for every module of the package."""
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path


def line_counts() -> dict[str, int]:
    """Lines of Python per top-level folder and per first-level subfolder."""
    counts: dict[str, int] = {}
    for _, path in source_files():
        relative = path.relative_to(ROOT)
        lines = len(path.read_text(encoding="utf-8").splitlines())
        keys = [relative.parts[0]]
        if len(relative.parts) > 2:
            keys.append("/".join(relative.parts[:2]))
        for key in keys:
            counts[key] = counts.get(key, 0) + lines
    return counts


def function_lengths() -> list[tuple[int, str]]:
    """``(lines, "path:line name")`` for every function and method."""
    found = []
    for _, path in source_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                found.append((length, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module name of a (possibly relative) ``from`` import."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _is_type_checking(node: ast.stmt) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"


def _imports(tree: ast.Module, runtime_only: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree``; with ``runtime_only``, not those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not (runtime_only and isinstance(node, ast.stmt) and _is_type_checking(node)):
            pending.extend(ast.iter_child_nodes(node))
    return found


def import_graph(runtime_only: bool = False) -> dict[str, set[str]]:
    """module -> the ``vllite`` modules it imports, at any depth of its source (``runtime_only``: leaving out the
    imports under ``if TYPE_CHECKING:``, which tie modules for a reader and a type checker but not at run time)."""
    modules = {name: path for name, path in source_files()}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in _imports(ast.parse(path.read_text(encoding="utf-8")), runtime_only):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = resolve(name, node, path.name == "__init__.py")
                submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
                # `from package import submodule` ties to the submodule, as `import package.submodule` does
                targets = submodules if len(submodules) == len(node.names) else [base, *submodules]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return sorted(circles, key=len, reverse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", type=int, default=12, help="how many of the longest functions to list")
    args = parser.parse_args(argv)
    print("## Lines per folder")
    for folder, lines in sorted(line_counts().items()):
        print(f"{lines:7d}  {folder}")
    print(f"\n## The {args.functions} longest functions")
    for length, where in function_lengths()[: args.functions]:
        print(f"{length:5d}  {where}")
    print("\n## Import circles (modules that import each other, at any depth)")
    for circle in import_circles(import_graph()):
        print(f"{len(circle):3d} modules: {', '.join(circle)}")
    print("\n## Import circles at run time (leaving out imports under `if TYPE_CHECKING:`)")
    for circle in import_circles(import_graph(runtime_only=True)):
        print(f"{len(circle):3d} modules: {', '.join(circle)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
