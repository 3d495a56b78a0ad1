"""Which plugins the environment lets load: the ``VLLITE_PLUGINS`` / ``VLLITE_DISABLED_PLUGINS`` /
``VLLITE_DISABLE_PLUGIN_AUTOLOAD`` filter and the entry points it allows.

:mod:`vllite.plugin_manager` describes the variables and applies the same filter's denials to its default builtins;
the logits-processor loader reads the entry points through :func:`iter_entry_points` too, so every entry-point group
and every process (frontend, engine core) loads the same plugins.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from vllite.exceptions import PluginLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EntryPointInfo:
    """One discovered entry point, with the distribution it came from (for error messages and ``vllite plugins``)."""

    name: str
    value: str
    group: str
    dist_name: str
    dist_version: str
    entry_point: Any = field(repr=False, compare=False)

    def describe(self) -> str:
        """``entry point NAME (VALUE) of distribution DIST VERSION``: how error messages name it."""
        return f"entry point {self.name!r} ({self.value}) of distribution {self.dist_name} {self.dist_version}"

    def load(self) -> Any:
        """Imports the entry point; any failure becomes a ``PluginLoadError`` naming it."""
        from vllite.plugins import vllm_compat  # a builtin adapter: imported here, not at module level

        vllm_compat.activate()  # plugins may `import vllm...`: served by vllite when no real vLLM is installed
        try:
            return self.entry_point.load()
        except Exception as exc:
            raise PluginLoadError(
                f"Failed to load {self.describe()} in group {self.group!r}: {type(exc).__name__}: {exc} "
                f"(VLLITE_DISABLED_PLUGINS={self.name} skips it)",
                plugin=self.name,
                distribution=self.dist_name,
            ) from exc


@dataclass(frozen=True)
class PluginFilter:
    """Which plugins may load. An entry point: one in ``allowed`` (``None``: any name) and not in ``denied``. A
    default builtin: any whose short name (or module path) is not in ``denied`` — only denials reach builtins."""

    allowed: frozenset[str] | None = None
    denied: frozenset[str] = frozenset()

    def allows(self, name: str) -> bool:
        """Whether the entry point ``name`` may load."""
        return (self.allowed is None or name in self.allowed) and name not in self.denied

    def denies_builtin(self, short_name: str | None, module: str) -> bool:
        """Whether the builtin plugin ``module`` (short name ``short_name``) is denied by name."""
        return module in self.denied or (short_name is not None and short_name in self.denied)


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def plugin_filter() -> PluginFilter:
    """The filter the environment sets (see :mod:`vllite.plugin_manager`): ``VLLITE_PLUGINS`` entries without ``-``
    allow, entries with a leading ``-`` and ``VLLITE_DISABLED_PLUGINS`` deny; only denials (or no ``VLLITE_PLUGINS``)
    allow every other name, ``VLLITE_PLUGINS=`` and ``VLLITE_DISABLE_PLUGIN_AUTOLOAD=1`` allow none. The denials are
    read in every case: they also turn default builtins off."""
    denied = set(_names(os.environ.get("VLLITE_DISABLED_PLUGINS", "")))
    value = os.environ.get("VLLITE_PLUGINS")
    entries = _names(value or "")
    allowed = {name for name in entries if not name.startswith("-")}
    denied.update(name[1:].strip() for name in entries if name.startswith("-") and name[1:].strip())
    if os.environ.get("VLLITE_DISABLE_PLUGIN_AUTOLOAD", "").strip() in ("1", "true", "True"):
        return PluginFilter(frozenset(), frozenset(denied))
    if value is None or (entries and not allowed):  # unset, or only denials: every other name
        return PluginFilter(None, frozenset(denied))
    return PluginFilter(frozenset(allowed), frozenset(denied))


def iter_entry_points(group: str) -> list[EntryPointInfo]:
    """The entry points of ``group`` that the environment's :func:`plugin_filter` allows, sorted."""
    allowed = plugin_filter()
    found: dict[tuple[str, str], EntryPointInfo] = {}
    for ep in metadata.entry_points(group=group):
        if not allowed.allows(ep.name):
            if ep.name in allowed.denied:
                logger.debug("Entry point %r of group %r is disabled by the environment", ep.name, group)
            continue
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else "<unknown>"
        dist_version = dist.version if dist is not None else "?"
        # The same distribution can be visible twice on sys.path (e.g. editable + build dir): keep one.
        found.setdefault((ep.name, ep.value), EntryPointInfo(ep.name, ep.value, group, dist_name, dist_version, ep))
    return sorted(found.values(), key=lambda info: (info.name, info.value))


def note_vllm_plugins() -> None:
    """Logs, when ``VLLM_PLUGINS`` is set, that vllite does not read it (see :mod:`vllite.plugin_manager`)."""
    if "VLLM_PLUGINS" in os.environ:
        logger.info(
            "VLLM_PLUGINS is set; vllite does not read it: in vLLM it selects the vllm.general_plugins / "
            "platform / IO-processor / stat-logger entry points, which vllite does not load, and vLLM loads the "
            "vllm.logits_processors entry points whatever it says. VLLITE_PLUGINS / VLLITE_DISABLED_PLUGINS "
            "filter vllite's plugins."
        )
