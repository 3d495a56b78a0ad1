"""The error contract: every deliberate error derives from ``vllite.exceptions.VlliteError``.

The package source is scanned with ``ast`` so that a new bare ``raise RuntimeError(...)`` (or ``Exception``)
fails here instead of slipping past review.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import vllite.exceptions as exc_mod
from vllite.exceptions import VlliteError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("core", "plugins", "schedulers", "builtin_logitsprocs", "vllite_kernels")
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


def test_vllite_errors_are_defined_in_vllite_exceptions_only():
    outside = []
    for path in _package_files():
        if path == ROOT / "core" / "exceptions.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and (b.id.endswith("Error") or b.id in BARE) for b in node.bases
            ):
                outside.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}")
    assert not outside, "define error classes in core/exceptions.py:\n" + "\n".join(outside)


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
        BenchReplayError,
        EngineClientClosedError,
        EngineStartupError,
        ExecutorFailedError,
        KVCacheStateError,
        UtilityCallError,
    )

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
