"""Old import names that keep working for one release: renamed packages and the builtins moved out of the kernel.

The tables are data (``deprecated_names.json`` beside this module); builtin packages add the modules that moved
out of them when they are imported (:func:`register_moves`).

A ``sys.meta_path`` finder maps each old name, and every submodule under it, to the module object of the new name
(``vllite.schedulers.continuum`` *is* ``vllite.policies.continuum``), so classes imported either way are the same
objects, and issues a ``DeprecationWarning`` the first time each old name is imported. Installed by
``import vllite``. Names that a kernel package re-exported from a moved module are served by that package's
``__getattr__`` through :func:`moved_attribute`, with the same warning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import sys
import warnings
from pathlib import Path
from types import ModuleType

_NAMES = json.loads((Path(__file__).with_name("deprecated_names.json")).read_text(encoding="utf-8"))
#: old package name -> new package name (removed in the release after the rename).
RENAMED_PACKAGES: dict[str, str] = _NAMES["renamed_packages"]
#: modules that moved, old name -> new name (removed in the release after the move): mostly builtins that lived in
#: the kernel, now in a plugin (a builtin package adds its own with :func:`register_moves`).
MOVED_MODULES: dict[str, str] = _NAMES["moved_modules"]
#: package -> {name it re-exported: the module that now holds it}.
MOVED_ATTRIBUTES: dict[str, dict[str, str]] = _NAMES["moved_attributes"]


def register_moves(old_package: str, new_package: str, pairs: str) -> None:
    """Serves each ``old:new`` pair of ``pairs`` (space-separated): ``old_package.old`` is ``new_package.new``. A
    builtin package calls this for the modules that moved out of it, so each table lives with the package that
    knows it (the package is imported before any of its old submodule names is looked up)."""
    for pair in pairs.split():
        old, new = pair.split(":")
        MOVED_MODULES[f"{old_package}.{old}"] = f"{new_package}.{new}"


def moved_attribute(package: str, name: str, moved: dict[str, str] | None = None) -> object:
    """``package.name`` for a name that moved out of ``package`` (``moved`` maps it to its module; by default
    :data:`MOVED_ATTRIBUTES` does), with a ``DeprecationWarning``; ``AttributeError`` for any other name. A
    package's ``__getattr__`` calls this."""
    module = (MOVED_ATTRIBUTES.get(package, {}) if moved is None else moved).get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(
        f"{package}.{name} is deprecated and will be removed in the next release; import it from {module} instead.",
        DeprecationWarning,
        stacklevel=3,  # the code that read the name, past the package's __getattr__
    )
    return getattr(importlib.import_module(module), name)


def _new_name(fullname: str) -> str | None:
    moved = MOVED_MODULES.get(fullname)
    if moved is not None:
        return moved
    for old, new in RENAMED_PACKAGES.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old) :]
    return None


def _caller_stacklevel() -> int:
    """The ``stacklevel`` (for a warning issued by the caller of this function) that points at the first frame
    outside this module. Like ``warnings.warn``, frames of the import system (``importlib._bootstrap``) are not
    counted."""
    frame = sys._getframe(2)  # the caller's caller
    level = 2
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = "importlib" in filename and "_bootstrap" in filename
        if not internal and filename != __file__:
            return level
        if not internal:
            level += 1
        frame = frame.f_back  # type: ignore[assignment]
    return level


class _AliasLoader(importlib.abc.Loader):
    """Hands the import system the already-imported module of the new name instead of a new module."""

    def __init__(self, old: str, new: str) -> None:
        self.old = old
        self.new = new
        self._own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{self.old} is deprecated and will be removed in the next release; import {self.new} instead.",
            DeprecationWarning,
            stacklevel=_caller_stacklevel(),
        )
        target = importlib.import_module(self.new)
        self._own_spec = target.__spec__
        return target

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just set the alias spec on the shared module object: give it back its own.
        module.__spec__ = self._own_spec


class DeprecatedAliasFinder(importlib.abc.MetaPathFinder):
    """Finds the renamed packages of :data:`RENAMED_PACKAGES` (and their submodules) under their old names."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = _new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, new))


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once), before a stale install could load a second copy."""
    if not any(isinstance(finder, DeprecatedAliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeprecatedAliasFinder())
