"""The house's one import rule: the kernel (``core/``, imported as ``vllite``) never imports a builtin at module level.

Builtins (``vllite.plugins``, ``vllite.policies``, ``vllite.builtin_logitsprocs``) are plugins like a third party's:
the kernel reaches them through the registries the plugin manager builds from their hooks, by registered name or
class path, never by a module-level import. An import inside a function (run only when that function is called) is
outside this rule; an import under ``if TYPE_CHECKING:`` or in a class body is at module level and inside it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNEL = Path(__file__).resolve().parents[1] / "core"
BUILTIN_PACKAGES = ("vllite.plugins", "vllite.policies", "vllite.builtin_logitsprocs")


def module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import that runs when the module is imported (or type-checked): the
    module body and the bodies of the ``if``/``try``/``with`` blocks and classes in it, not function bodies."""
    found: list[tuple[int, str]] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                pending.extend(getattr(node, field, ()))
    return sorted(found)


def imports_of_builtins(source: str) -> list[str]:
    """The module-level imports of ``source`` that reach into a builtin package, as ``line N: name``."""
    return [
        f"line {line}: {name}"
        for line, name in module_level_imports(ast.parse(source))
        if any(name == package or name.startswith(package + ".") for package in BUILTIN_PACKAGES)
    ]


KERNEL_MODULES = sorted(KERNEL.rglob("*.py"))


@pytest.mark.parametrize("path", KERNEL_MODULES, ids=lambda path: str(path.relative_to(KERNEL)))
def test_kernel_module_imports_no_builtin_at_module_level(path: Path) -> None:
    violations = imports_of_builtins(path.read_text(encoding="utf-8"))
    assert not violations, (
        f"core/{path.relative_to(KERNEL)} imports builtins at module level ({'; '.join(violations)}): reach them "
        "through the plugin registry (vllite.plugin_manager.resolve_component) or import inside the function"
    )


def test_the_rule_sees_every_form_of_module_level_import() -> None:
    source = """
import vllite.plugins.engine_proc
from vllite.policies import fcfs
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from vllite.builtin_logitsprocs.min_p import MinPLogitsProcessor
try:
    import vllite.plugins.ray_dp as ray_dp
except ImportError:
    from vllite.plugins import openai_server
class Holder:
    from vllite.policies.continuum import ContinuumScheduler
def lazy():
    from vllite.plugins.transformers_executor import executor
from vllite.pluginsx import not_a_builtin
from vllite.sched import Scheduler
"""
    assert imports_of_builtins(source) == [
        "line 2: vllite.plugins.engine_proc",
        "line 3: vllite.policies.fcfs",
        "line 6: vllite.builtin_logitsprocs.min_p.MinPLogitsProcessor",
        "line 8: vllite.plugins.ray_dp",
        "line 10: vllite.plugins.openai_server",
        "line 12: vllite.policies.continuum.ContinuumScheduler",
    ]


def test_the_kernel_folder_is_where_the_rule_looks() -> None:
    assert (KERNEL / "plugin_manager.py").is_file()
    assert len(KERNEL_MODULES) > 50
