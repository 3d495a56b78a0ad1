"""Old import names that keep working for one release: ``vllite.schedulers`` and ``vllite.plugins.executor``.

A ``sys.meta_path`` finder maps each old name, and every submodule under it, to the module object of the new name
(``vllite.schedulers.continuum`` *is* ``vllite.policies.continuum``), so classes imported either way are the same
objects, and issues a ``DeprecationWarning`` the first time each old name is imported. Installed by
``import vllite``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old package name -> new package name (removed in the release after the rename).
RENAMED_PACKAGES: dict[str, str] = {
    "vllite.schedulers": "vllite.policies",
    "vllite.plugins.executor": "vllite.plugins.transformers_executor",
}


def _new_name(fullname: str) -> str | None:
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
