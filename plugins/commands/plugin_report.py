"""What ``vllite plugins`` reports: every plugin and logits processor the engine would load, a broken one marked
with the error start-up would raise instead of stopping the report.

Rows, in order: the pluggy plugins (builtins, then the ``vllite`` entry-point group) with the hooks they implement
and what they register, then one row per entry point of the ``vllm.logits_processors`` /
``vllite.logits_processors`` groups. Everything goes through the engine's own code: the environment's plugin
filter and the registries' checks (duplicate names, the required methods of what a plugin registered as an object).
A listing imports no component a plugin registered by class path and no logits-processor entry point (so it
imports no torch); with ``check=True`` every component is imported as well, and every logits processor goes
through the loader's :func:`~vllite.logits_processor.loader.check_source`, exactly as engine start-up does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from vllite.exceptions import PluginLoadError

if TYPE_CHECKING:
    from vllite.plugin_manager import Component, PluginManager

Mark = Callable[[str | None, str], None]

#: The distribution column of a builtin (and of a plugin registered at run time).
BUILTIN_DISTRIBUTION = "vllite (builtin)"


@dataclass
class PluginRow:
    """One line of the report. ``errors`` holds the ``PluginLoadError`` messages of everything broken in it (empty:
    it loads); ``disable_name`` is the name that ``VLLITE_DISABLED_PLUGINS`` takes to turn it off (an entry point's
    name, a default builtin's short name; ``None`` for an essential builtin). A builtin's ``builtin`` is
    ``"essential"`` or ``"default"`` (``None``: not a builtin) and ``short_name`` its name in
    ``vllite.plugin_manager.ESSENTIAL_PLUGINS`` / ``DEFAULT_PLUGINS``; ``status`` is ``"loaded"``, or ``"disabled"``
    for a default builtin the environment turned off."""

    name: str
    distribution: str
    group: str | None
    hooks: list[str] = field(default_factory=list)
    components: dict[str, list[str]] = field(default_factory=dict)
    entry_point: str | None = None
    cls: str | None = None
    errors: list[str] = field(default_factory=list)
    disable_name: str | None = None
    builtin: str | None = None
    short_name: str | None = None
    status: str = "loaded"

    @property
    def broken(self) -> bool:
        return bool(self.errors)

    def add_error(self, message: str) -> None:
        if message not in self.errors:
            self.errors.append(message)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["class"] = data.pop("cls")
        if self.entry_point is None:
            del data["entry_point"], data["class"]
        return data


def _class_path(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def hook_plugin_rows(check: bool = False) -> list[PluginRow]:
    """The pluggy plugins, with what each registers; registry errors (and, with ``check``, components that fail to
    load and broken hook-registered logits processors) are marked on the plugin that caused them."""
    from vllite.plugin_manager import COMPONENT_KINDS, get_plugin_manager

    manager = get_plugin_manager()
    rows = _plugin_rows(manager)

    def mark(plugin: str | None, message: str) -> None:
        row = rows.get(plugin or "")
        if row is None:  # not pinned to one plugin: report it on its own line
            row = rows.setdefault("?", PluginRow(name="?", distribution="?", group=None))
        row.add_error(message)

    for kind in COMPONENT_KINDS:
        registered, hook_errors = manager.registrations(kind)
        for component in registered:
            names = rows[component.plugin].components.setdefault(kind, [])
            if component.name not in names:
                names.append(component.name)
        for error in hook_errors:
            mark(error.plugin, str(error))
        if check and kind == "logits_processors":
            _check_registered_logitsprocs(manager, registered, mark)
        elif check:
            _load_components(registered, mark)
        try:
            manager.components(kind)
        except PluginLoadError as exc:  # duplicate names, missing methods: the first one start-up would raise
            row = rows.get(exc.plugin or "")
            if row is None or not row.errors:  # a broken processor is already marked by its own check
                mark(exc.plugin, str(exc))
    for row in rows.values():
        for names in row.components.values():
            names.sort()
    return list(rows.values())


def _plugin_rows(manager: PluginManager) -> dict[str, PluginRow]:
    """One row per builtin (in their order, the disabled ones too: marked so, with nothing registered), then one per
    other plugin: the ``vllite`` entry points and plugins registered at run time."""
    rows: dict[str, PluginRow] = {}
    for plugin in manager.builtins:
        rows[plugin.module] = PluginRow(
            name=plugin.module,
            distribution=BUILTIN_DISTRIBUTION,
            group=None,
            disable_name=None if plugin.essential else plugin.short_name,
            builtin=plugin.kind,
            short_name=plugin.short_name,
            status="disabled" if plugin.disabled else "loaded",
        )
    for name, obj in manager.pm.list_name_plugin():
        info = manager.entry_points.get(name)
        row = rows.get(name)
        if row is None:
            row = rows[name] = PluginRow(
                name=name,
                distribution=f"{info.dist_name} {info.dist_version}" if info else BUILTIN_DISTRIBUTION,
                group=info.group if info else None,
                disable_name=name if info else None,
            )
        row.hooks = sorted(caller.name for caller in manager.pm.get_hookcallers(obj) or [])
    return rows


def _check_registered_logitsprocs(manager: PluginManager, registered: list[Component], mark: Mark) -> None:
    from vllite.logits_processor.loader import check_source
    from vllite.logits_processor.sources import hook_sources

    for source in hook_sources(manager, registered):
        try:
            check_source(source)
        except PluginLoadError as exc:
            mark(source.plugin, str(exc))


def _load_components(registered: list[Component], mark: Mark) -> None:
    for component in registered:
        try:
            component.load()
        except PluginLoadError as exc:
            mark(component.plugin, str(exc))


def logits_processor_rows(check: bool = False) -> list[PluginRow]:
    """One row per logits-processor entry point the environment's filter allows; with ``check``, each is loaded
    and checked as the engine's loader does, and a broken one carries the ``PluginLoadError`` start-up would
    raise."""
    from vllite.logits_processor.loader import check_logitsproc_class
    from vllite.logits_processor.sources import entry_point_sources
    from vllite.plugins.vllm_compat.slot_adapter import is_slot_interface

    rows = []
    for source in entry_point_sources():
        row = PluginRow(
            name=source.name,
            distribution=f"{source.distribution} {source.dist_version}",
            group=source.group,
            components={"logits_processors": [source.name]},
            entry_point=source.reference,
            disable_name=source.name,
        )
        rows.append(row)
        if not check:
            continue
        try:
            obj = source.load()
            slot = isinstance(obj, type) and is_slot_interface(obj)
            row.cls = _class_path(obj) + (" (slot interface, adapted)" if slot else "")
            check_logitsproc_class(obj, origin=source.origin, plugin=source.plugin, distribution=source.distribution)
        except PluginLoadError as exc:
            row.add_error(str(exc))
    return rows


def plugin_report(check: bool = False) -> list[PluginRow]:
    """Every row of ``vllite plugins``: the pluggy plugins, then the logits-processor entry points; ``check``
    imports and checks every component (see the module docstring)."""
    return hook_plugin_rows(check) + logits_processor_rows(check)
