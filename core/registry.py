"""What the register hooks build: ``Component`` (one registration) and ``Registry`` (the components of one kind).

A plugin registers either the object itself (``register("fcfs", FCFSScheduler)``) or its class path
(``register("fcfs", "vllite.policies.fcfs:FCFSScheduler")``). A class path is imported the first time the entry is
read, so listing what is registered (``vllite plugins``, ``vllite --help``) imports none of the heavy modules
behind it, and an engine imports only the components it uses.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllite.exceptions import PluginLoadError

_NOT_LOADED: Any = object()


def resolve_class_path(path: str) -> Any:
    """Imports ``pkg.mod:Class`` or ``pkg.mod.Class`` (nested attributes allowed after the colon)."""
    if not isinstance(path, str) or not path.strip():
        raise PluginLoadError(f"Invalid class path {path!r}: expected 'pkg.mod:Class' or 'pkg.mod.Class'.")
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise PluginLoadError(f"Invalid class path {path!r}: expected 'pkg.mod:Class' or 'pkg.mod.Class'.")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise PluginLoadError(
            f"Cannot import module {module_name!r} of class path {path!r}: {type(exc).__name__}: {exc}",
            plugin=path,
        ) from exc
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError as exc:
            raise PluginLoadError(
                f"Module {module_name!r} has no attribute {attr_path!r} ({path!r}).", plugin=path
            ) from exc
    return obj


@dataclass
class Component:
    """One registration: ``target`` is what plugin ``plugin`` registered under ``name`` for component ``kind`` —
    the object, or its class path, imported by the first :meth:`load`.

    ``required`` are the attributes the kind's interface needs; ``source`` describes the plugin for messages and
    ``distribution`` names the distribution that installed it (``None`` for builtins and run-time plugins).
    """

    name: str
    target: Any
    plugin: str
    builtin: bool
    kind: str
    required: tuple[str, ...] = ()
    source: str = ""
    distribution: str | None = None
    _obj: Any = field(default=_NOT_LOADED, repr=False, compare=False)

    @property
    def reference(self) -> str:
        """The class path that names the component (imports nothing)."""
        if isinstance(self.target, str):
            return self.target
        module, qualname = getattr(self.target, "__module__", None), getattr(self.target, "__qualname__", None)
        return f"{module}:{qualname}" if module and qualname else repr(self.target)

    def load(self) -> Any:
        """The component object, imported on first use for a class path. A failed import, or an object without
        the kind's required attributes, raises ``PluginLoadError`` naming the plugin and the entry."""
        if self._obj is _NOT_LOADED:
            obj = self.resolve()
            missing = [attr for attr in self.required if not hasattr(obj, attr)]
            if missing:
                raise self._error(f"which lacks {', '.join(missing)}", obj=obj)
            self._obj = obj
        return self._obj

    def resolve(self) -> Any:
        """The registered object, imported if it is a class path, not checked (for a caller that checks it more
        closely itself, as the logits-processor loader does)."""
        if not isinstance(self.target, str):
            return self.target
        try:
            return resolve_class_path(self.target)
        except PluginLoadError as exc:
            raise self._error(f"which cannot be loaded: {exc}") from exc

    def _error(self, problem: str, *, obj: Any = _NOT_LOADED) -> PluginLoadError:
        shown = self.target if obj is _NOT_LOADED else obj
        return PluginLoadError(
            f"{self.source or self.plugin} registered {self.kind[:-1]} {self.name!r} ({shown!r}) {problem}.",
            plugin=self.plugin,
            distribution=self.distribution,
        )


class Registry(Mapping[str, Any]):
    """``name -> component object`` of one kind. Reading an entry loads it (:meth:`Component.load`); names, ``in``
    and ``len`` load nothing."""

    def __init__(self, components: Mapping[str, Component]) -> None:
        self.components = components

    def __getitem__(self, name: str) -> Any:
        return self.components[name].load()

    def __iter__(self) -> Iterator[str]:
        return iter(self.components)

    def __len__(self) -> int:
        return len(self.components)
