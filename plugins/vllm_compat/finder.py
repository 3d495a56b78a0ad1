"""The ``sys.meta_path`` finder and loader that serve ``vllm.*`` names when no real vLLM is importable.

The finder answers for ``vllm`` only after asking every other finder on ``sys.meta_path``: when one of them finds
a real ``vllm``, it returns ``None`` and the real package is imported. For ``vllm.x.y`` it answers only when the
``vllm`` already imported is this layer's, and then either serves the module (a module object whose names,
listed in :data:`~vllite.plugins.vllm_compat.served.SERVED_MODULES`, resolve to vllite's objects on first use) or
raises :class:`~vllite.plugins.vllm_compat.finder.VllmCompatImportError` saying what the layer does provide.

Every served module is a package, so ``from vllm.config import Missing`` also reaches the finder (as the
import of ``vllm.config.Missing``) and fails with that message rather than Python's bare "cannot import name".
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any

from vllite.exceptions import VlliteError
from vllite.plugins.vllm_compat.served import SERVED_MODULES, VLLM_API_VERSION, submodules
from vllite.version import __version__ as _vllite_version


class VllmCompatImportError(VlliteError, ModuleNotFoundError):
    """A ``vllm.*`` name that vllite's vLLM compatibility layer does not serve (no real vLLM is installed); the
    message names it and lists what the layer does serve."""


TOP = "vllm"
#: ``vllm.__version__`` of the served package: the vLLM API followed, with vllite's version as local label.
SERVED_VERSION = f"{VLLM_API_VERSION}+vllite.{_vllite_version}"
_ORIGIN = "vllite.plugins.vllm_compat"
_MARKER = "__vllite_compat__"
_lock = threading.Lock()


def is_shim_module(module: object) -> bool:
    """True if ``module`` was served by this layer (not a real vLLM module)."""
    return isinstance(module, ModuleType) and module.__dict__.get(_MARKER) is True


def _provided(name: str) -> str:
    names = ", ".join(sorted(SERVED_MODULES.get(name, {}))) or "no names of its own"
    children = ", ".join(submodules(name)) or "none"
    return f"{name} provides {names}; its submodules: {children}."


def missing_message(fullname: str) -> str:
    """What the layer says about a ``vllm.*`` name (module or attribute) it does not serve."""
    parent = fullname.rpartition(".")[0]
    return (
        f"vllite's vLLM compatibility layer does not provide {fullname!r}: vLLM is not installed, and vllite serves "
        f"only the vllm.* names that logits-processor and tool-parser plugins import. {_provided(parent)} "
        f"Served modules: "
        f"{', '.join(sorted(SERVED_MODULES))}. Install vLLM to use other parts of it."
    )


def _resolve(reference: str) -> Any:
    module_name, _, attr_path = reference.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    return obj


class _LazyNames:
    """A served module's ``__getattr__``: resolves a served name to its vllite object on first use and keeps it
    in the module, so later reads are plain attribute reads."""

    def __init__(self, module: ModuleType, names: dict[str, str]) -> None:
        self.module = module
        self.names = names

    def __call__(self, attr: str) -> Any:
        reference = self.names.get(attr)
        if reference is None:
            raise AttributeError(missing_message(f"{self.module.__name__}.{attr}"), name=attr, obj=self.module)
        value = _resolve(reference)
        setattr(self.module, attr, value)
        return value

    def dir(self) -> list[str]:
        """The module's ``__dir__``: its attributes plus the names not resolved yet."""
        return sorted(set(self.module.__dict__) | set(self.names))


class VllmCompatLoader(importlib.abc.Loader):
    """Fills a new module object for a served ``vllm.*`` name: its served names (resolved lazily), ``__all__``,
    and for ``vllm`` itself ``__version__``."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the import system's default module object

    def exec_module(self, module: ModuleType) -> None:
        names = SERVED_MODULES[module.__name__]
        lazy = _LazyNames(module, names)
        module.__doc__ = (
            f"vllite's stand-in for {module.__name__} (vllite.plugins.vllm_compat; no real vLLM is installed). "
            + _provided(module.__name__)
        )
        module.__dict__.update(
            {"__all__": sorted(names), "__getattr__": lazy, "__dir__": lazy.dir, _MARKER: True},
        )
        if module.__name__ == TOP:
            module.__dict__["__version__"] = SERVED_VERSION


_LOADER = VllmCompatLoader()


def _real_vllm_findable(self_finder: object) -> bool:
    """Whether any other finder on ``sys.meta_path`` finds a ``vllm`` package. A namespace package (a bare
    ``vllm/`` folder without ``__init__.py``, say a data folder in the working directory) is no vLLM."""
    for finder in list(sys.meta_path):
        if isinstance(finder, VllmCompatFinder) or finder is self_finder:
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(TOP, None)
        except Exception:  # a broken third-party finder must not hide the answer of the others
            continue
        if spec is not None and spec.origin not in (None, "namespace"):
            return True
    return False


class VllmCompatFinder(importlib.abc.MetaPathFinder):
    """Serves the ``vllm.*`` names of :data:`SERVED_MODULES` unless a real vLLM is importable (see the module
    docstring). Installed by :func:`activate`, first on ``sys.meta_path``: it asks the other finders itself, and
    must come before the path finder, which would otherwise take a bare ``vllm/`` folder for a package."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == TOP:
            if _real_vllm_findable(self):
                return None
            return importlib.machinery.ModuleSpec(TOP, _LOADER, origin=_ORIGIN, is_package=True)
        if not fullname.startswith(TOP + "."):
            return None
        parent = fullname.rpartition(".")[0]
        if not is_shim_module(sys.modules.get(parent)):
            return None  # a real vLLM (or nothing) is imported under that name: not ours to answer
        if fullname in SERVED_MODULES:
            return importlib.machinery.ModuleSpec(fullname, _LOADER, origin=_ORIGIN, is_package=True)
        # name= the served parent, not fullname: for `from vllm.x import Missing` the import system would
        # otherwise swallow this error and raise a bare "cannot import name" instead.
        raise VllmCompatImportError(missing_message(fullname), name=parent)


def is_active() -> bool:
    """True while the finder is on ``sys.meta_path``."""
    return any(isinstance(finder, VllmCompatFinder) for finder in sys.meta_path)


def activate() -> None:
    """Puts the finder first on ``sys.meta_path`` (once; cheap to call again). From then on ``import vllm…`` gets
    a real vLLM when one is importable, else this layer's modules. vllite calls it before it imports any plugin,
    in every process; call it yourself before importing such a plugin class in your own code."""
    with _lock:
        if not is_active():
            sys.meta_path.insert(0, VllmCompatFinder())


def deactivate() -> None:
    """Removes the finder and forgets the modules it served (``sys.modules``), so a later ``import vllm`` finds
    whatever is installed then. Objects already imported from them stay usable."""
    with _lock:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, VllmCompatFinder)]
        for name in [name for name, module in sys.modules.items() if is_shim_module(module)]:
            del sys.modules[name]
