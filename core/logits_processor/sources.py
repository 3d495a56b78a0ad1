"""Where the engine's logits-processor classes come from, before they are loaded and checked.

Two kinds of source are discovered: classes registered through the ``vllite_register_logits_processors`` hook
(builtins first) and the entry points of the ``vllm.logits_processors`` / ``vllite.logits_processors`` groups
(filtered by the environment like every group). The engine's loader and ``vllite plugins`` build the same sources
with the same descriptions, so the command checks exactly what engine start-up checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllite.plugin_manager import Component, EntryPointInfo, PluginManager

LOGITSPROCS_GROUP = "vllm.logits_processors"
LOGITSPROCS_GROUPS = (LOGITSPROCS_GROUP, "vllite.logits_processors")


@dataclass(frozen=True)
class LogitsProcSource:
    """One processor class, not yet loaded or checked, and where it comes from.

    ``name`` is the registered name or the entry point's name; ``origin`` describes the source for messages (the
    name, the entry point and its distribution); ``plugin`` is the entry point that contributed the class (for a
    hook registration, the plugin whose hook registered it) and ``distribution`` the distribution that installed
    it (``None`` for builtins and run-time registrations); ``group`` is the entry-point group (``None`` for a hook
    registration); ``reference`` is what names the class in that source (``pkg.mod:Class`` for an entry point).
    """

    name: str
    origin: str
    plugin: str | None
    distribution: str | None
    dist_version: str | None
    group: str | None
    reference: str | None
    getter: Callable[[], Any] = field(repr=False, compare=False)

    def load(self) -> Any:
        """What the source holds (normally a class); an import failure raises ``PluginLoadError`` naming it."""
        return self.getter()


def hook_sources(manager: PluginManager, components: Iterable[Component]) -> list[LogitsProcSource]:
    """A source per component registered through the logits-processor hook (``manager.components(...)`` for what
    the engine uses, ``manager.registrations(...)`` for every registration)."""
    sources = []
    for component in components:
        info = manager.entry_points.get(component.plugin)
        sources.append(
            LogitsProcSource(
                name=component.name,
                origin=f"logits processor {component.name!r} registered by {manager.describe_plugin(component.plugin)}",
                plugin=component.plugin,
                distribution=info.dist_name if info else None,
                dist_version=info.dist_version if info else None,
                group=None,
                reference=component.reference,
                getter=component.resolve,
            )
        )
    return sources


def _entry_point_source(info: EntryPointInfo) -> LogitsProcSource:
    return LogitsProcSource(
        name=info.name,
        origin=f"{info.describe()} in group {info.group!r}",
        plugin=info.name,
        distribution=info.dist_name,
        dist_version=info.dist_version,
        group=info.group,
        reference=info.value,
        getter=info.load,
    )


def entry_point_sources() -> list[LogitsProcSource]:
    """A source per entry point of the logits-processor groups that the environment's filter allows, group by
    group, each group sorted by name."""
    from vllite.plugin_manager import iter_entry_points

    return [_entry_point_source(info) for group in LOGITSPROCS_GROUPS for info in iter_entry_points(group)]
