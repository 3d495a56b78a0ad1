"""The error contract: every deliberate error derives from ``vllite.exceptions.VlliteError``.

The package source is scanned with ``ast`` so that a new bare ``raise RuntimeError(...)`` (or ``Exception``)
fails here instead of slipping past review.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import vllite.exceptions as exc_mod
from vllite.exceptions import VlliteError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("core", "plugins", "schedulers", "builtin_logitsprocs", "vllite_kernels", "vllite_platform")
PACKAGE_FOLDERS += ("vllite_testing",)
BARE = {"RuntimeError", "Exception"}


def _package_files() -> list[Path]:
    return sorted(p for folder in PACKAGE_FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _bare_name(node: ast.expr | None) -> str | None:
    """``RuntimeError`` for ``raise RuntimeError`` and ``raise RuntimeError(...)``; None otherwise."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name) and node.id in BARE:
        return node.id
    return None


def test_no_bare_builtin_errors_raised_in_the_package():
    offenders = []
    for path in _package_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Raise):
                name = _bare_name(node.exc)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "set_exception"
                and node.args
            ):
                # future.set_exception(RuntimeError(...)) raises it in the caller just the same
                name = _bare_name(node.args[0])
            if name is not None:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not offenders, "raise a vllite.exceptions.VlliteError subclass instead:\n" + "\n".join(offenders)


def _error_classes_outside_exceptions() -> list[tuple[Path, ast.ClassDef]]:
    """The classes deriving from a name ending in ``Error`` (or a bare builtin) outside ``core/exceptions.py``."""
    found = []
    for path in _package_files():
        if path == ROOT / "core" / "exceptions.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and (b.id.endswith("Error") or b.id in BARE) for b in node.bases
            ):
                found.append((path, node))
    return found


def test_kernel_errors_are_defined_in_vllite_exceptions_only():
    outside = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}"
        for path, node in _error_classes_outside_exceptions()
        if path.relative_to(ROOT).parts[0] in ("core", "vllite_platform")
    ]
    assert not outside, "define the kernel's error classes in core/exceptions.py:\n" + "\n".join(outside)


def test_a_plugins_own_errors_are_documented_vllite_errors_in_a_module_the_kernel_names():
    """A plugin keeps its errors in its own modules (they are its contract, not the kernel's): each derives from
    ``VlliteError``, has a docstring, and its module is one that ``vllite.exceptions`` points readers to."""
    from vllite.deprecated_aliases import MOVED_ATTRIBUTES

    owners = set(MOVED_ATTRIBUTES["vllite.exceptions"].values())
    found = _error_classes_outside_exceptions()
    assert len(found) >= 20
    for path, node in found:
        module = house_module(path)
        cls = getattr(importlib.import_module(module), node.name)
        assert issubclass(cls, VlliteError) and cls.__doc__, f"{module}.{node.name}"
        assert module in owners, f"{module} is not named as an error owner"
    for owner in owners - {"vllite.testing.kv_connector_conformance"}:
        assert ".".join(owner.split(".")[-2:]) in (exc_mod.__doc__ or ""), owner


def house_module(path: Path) -> str:
    packages = {"plugins": "vllite.plugins", "schedulers": "vllite.policies", "vllite_testing": "vllite.testing"}
    packages |= {"builtin_logitsprocs": "vllite.builtin_logitsprocs", "vllite_kernels": "vllite.kernels"}
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([packages[folder], *parts])


ERROR_CLASSES = [
    obj
    for _, obj in inspect.getmembers(exc_mod, inspect.isclass)
    if issubclass(obj, BaseException) and obj.__module__ == exc_mod.__name__
]


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_is_a_documented_vllite_error(cls):
    assert issubclass(cls, VlliteError)
    assert cls.__doc__ and cls.__doc__.strip()
    assert cls.__name__ in (exc_mod.__doc__ or "") or cls is VlliteError


def test_former_runtime_errors_stay_catchable_as_runtime_error():
    from vllite.exceptions import (
        BatchStateError,
        EngineClientClosedError,
        EngineStartupError,
        ExecutorFailedError,
        KVCacheStateError,
        UtilityCallError,
    )
    from vllite.plugins.bench.errors import BenchReplayError

    for cls in (
        BatchStateError,
        BenchReplayError,
        EngineClientClosedError,
        EngineStartupError,
        ExecutorFailedError,
        KVCacheStateError,
        UtilityCallError,
    ):
        assert issubclass(cls, RuntimeError) and issubclass(cls, VlliteError)
