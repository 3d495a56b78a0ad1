"""The house's import rules, kept by tests: which package may import which (see ``RULES``).

The kernel (``core/``, imported as ``vllite``) never imports a builtin at module level: builtins
(``vllite.plugins``, ``vllite.policies``, ``vllite.builtin_logitsprocs``) are plugins like a third party's, and the
kernel reaches them through the registries the plugin manager builds from their hooks, by registered name or class
path. An import inside a function (run only when that function is called) is outside that rule; an import under
``if TYPE_CHECKING:`` or in a class body is at module level and inside it. The rules between builtins hold at any
depth, function bodies included: a lazy import still ties two packages together.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("house_report", ROOT / "scripts" / "house_report.py")
assert _spec is not None and _spec.loader is not None
house_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(house_report)

BUILTIN_PACKAGES = ("vllite.plugins", "vllite.policies", "vllite.builtin_logitsprocs")


@dataclass(frozen=True)
class Rule:
    """Modules under ``folder`` (but the ``exempt`` ones, relative to it) import nothing under ``forbidden``."""

    name: str
    folder: str
    forbidden: tuple[str, ...]
    why: str
    any_depth: bool = True  # False: only imports that run when the module is imported count
    exempt: tuple[str, ...] = ()
    allowed: tuple[str, ...] = ()  # names under ``forbidden`` that stay allowed


RULES = (
    Rule(
        "kernel-no-builtin-at-module-level",
        "core",
        BUILTIN_PACKAGES,
        "reach them through the plugin registry (vllite.plugin_manager.resolve_component) or import inside the "
        "function",
        any_depth=False,
    ),
    Rule(
        "plugins-no-policy",
        "plugins",
        ("vllite.policies",),
        "plugins reach the scheduling policies by registered name through the plugin registry, never by import",
    ),
    Rule(
        "openai-routers-no-app",
        "plugins/openai_server",
        ("vllite.plugins.openai_server.app",),
        "app.py assembles the routers; a router importing it ties the two together (share through http_common.py)",
        exempt=("app.py", "cli.py", "__init__.py"),
    ),
    Rule(
        "engine-proc-no-transformers-executor",
        "plugins/engine_proc",
        ("vllite.plugins.transformers_executor",),
        "the engine process hosts any executor: CPU thread placement comes from the platform layer",
    ),
    Rule(
        "policies-no-plugin",
        "schedulers",
        ("vllite.plugins",),
        "policies import the kernel only; a plugin they need (a tool parser) is found through the registry",
    ),
    Rule(
        "platform-below-kernel",
        "vllite_platform",
        ("vllite",),
        "the platform layer sits below the kernel and every plugin, which all reach it downward; it shares only "
        "the errors",
        allowed=("vllite.exceptions", "vllite.platform"),
    ),
)


def import_nodes(tree: ast.Module, any_depth: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree``: with ``any_depth`` all of them, else those that run when the module is
    imported (or type-checked): the module body and the bodies of the blocks and classes in it, not function
    bodies."""
    if any_depth:
        yield from (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))
        return
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                pending.extend(getattr(node, field, ()))


def module_name(path: str) -> tuple[str, bool]:
    """The dotted name of the module at ``path`` (relative to the repository root), and whether it is a package."""
    folder, *parts = Path(path).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join([house_report.PACKAGES[folder], *(parts[:-1] if is_package else parts)]), is_package


def imports(source: str, path: str, any_depth: bool) -> list[tuple[int, str]]:
    """``(line, imported name)`` for the imports of the module at ``path`` whose source is ``source``; a
    ``from`` import names each imported name in full, and a relative one is resolved against ``path``."""
    module, is_package = module_name(path)
    found: list[tuple[int, str]] = []
    for node in import_nodes(ast.parse(source), any_depth):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        else:
            base = house_report.resolve(module, node, is_package)
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return sorted(found)


def violations(rule: Rule, path: str, source: str) -> list[str]:
    """The imports of ``source`` (the module at ``path``) that break ``rule``, as ``line N: name``."""
    if Path(path).relative_to(rule.folder).as_posix() in rule.exempt:
        return []
    return [
        f"line {line}: {name}"
        for line, name in imports(source, path, rule.any_depth)
        if _under(name, rule.forbidden) and not _under(name, rule.allowed)
    ]


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def covered(rule: Rule) -> list[str]:
    """The modules ``rule`` looks at, as paths relative to the repository root."""
    return [path.relative_to(ROOT).as_posix() for path in sorted((ROOT / rule.folder).rglob("*.py"))]


CASES = [(rule, path) for rule in RULES for path in covered(rule)]


@pytest.mark.parametrize(("rule", "path"), CASES, ids=[f"{rule.name}:{path}" for rule, path in CASES])
def test_module_keeps_the_import_rule(rule: Rule, path: str) -> None:
    found = violations(rule, path, (ROOT / path).read_text(encoding="utf-8"))
    assert not found, f"{path} imports {' or '.join(rule.forbidden)} ({'; '.join(found)}): {rule.why}"


def test_the_kernel_rule_sees_every_form_of_module_level_import() -> None:
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
from .plugins import relative_builtin
"""
    assert violations(RULES[0], "core/example.py", source) == [
        "line 2: vllite.plugins.engine_proc",
        "line 3: vllite.policies.fcfs",
        "line 6: vllite.builtin_logitsprocs.min_p.MinPLogitsProcessor",
        "line 8: vllite.plugins.ray_dp",
        "line 10: vllite.plugins.openai_server",
        "line 12: vllite.policies.continuum.ContinuumScheduler",
        "line 17: vllite.plugins.relative_builtin",
    ]


#: Per rule: a module path it covers, a source breaking it (its one offending import on line 3, inside a function,
#: written relatively where the package allows), and a source keeping it.
SAMPLES = {
    "plugins-no-policy": (
        "plugins/bench/example.py",
        "import vllite.plugin_manager\ndef make():\n    from ...policies import fcfs\n",
        "from vllite.plugin_manager import resolve_component\nfrom vllite.policiesx import y\n",
    ),
    "openai-routers-no-app": (
        "plugins/openai_server/ops/example.py",
        "from ..context import ServerContext\ndef routes():\n    from ..app import build_app\n",
        "from .context import ServerContext\nfrom vllite.plugins.openai_server import apps\n",
    ),
    "engine-proc-no-transformers-executor": (
        "plugins/engine_proc/example.py",
        "from vllite.config import VlliteConfig\ndef place():\n    from ..transformers_executor import cpu_threads\n",
        "from vllite.plugins.engine_proc.serial import encode\nimport vllite.platforms\n",
    ),
    "platform-below-kernel": (
        "vllite_platform/example.py",
        "from vllite.exceptions import VlliteError\ndef f():\n    from vllite.config import EngineConfig\n",
        "from vllite.exceptions import CpuThreadsConfigError\nfrom vllite.platform import cuda_available\n",
    ),
    "policies-no-plugin": (
        "schedulers/example.py",
        "from vllite.sched import Scheduler\nclass Policy(Scheduler):\n    def f(self): import vllite.plugins.bench\n",
        "from vllite.sched import Scheduler\nfrom vllite.plugin_manager import resolve_component\n",
    ),
}


@pytest.mark.parametrize("rule", RULES[1:], ids=lambda rule: rule.name)
def test_each_builtin_rule_catches_a_violation(rule: Rule) -> None:
    path, breaking, keeping = SAMPLES[rule.name]
    assert len(violations(rule, path, breaking)) == 1
    assert violations(rule, path, breaking)[0].startswith("line 3: ")
    assert violations(rule, path, keeping) == []


def test_exempt_modules_are_exempt_and_exist() -> None:
    rule = next(rule for rule in RULES if rule.exempt)
    source = "def f():\n    from . import app\n"
    assert violations(rule, f"{rule.folder}/cli.py", source) == []
    assert violations(rule, f"{rule.folder}/cli_x.py", source) == [f"line 2: {rule.forbidden[0]}"]
    for rule in RULES:
        assert all((ROOT / rule.folder / name).is_file() for name in rule.exempt), rule.name


def test_the_rules_look_where_the_modules_are() -> None:
    assert (ROOT / "core" / "plugin_manager.py").is_file()
    assert len(covered(RULES[0])) > 50
    assert all(covered(rule) for rule in RULES)
    assert module_name("plugins/openai_server/__init__.py") == ("vllite.plugins.openai_server", True)
    assert module_name("schedulers/fcfs.py") == ("vllite.policies.fcfs", False)
