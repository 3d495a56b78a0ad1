"""Selecting a reasoning parser by name (``--reasoning-parser``): the ``reasoning_parsers`` registry the plugin
manager builds from every plugin's ``vllite_register_reasoning_parsers`` hook, builtins first."""

from __future__ import annotations

from vllite.exceptions import PluginLoadError

REQUIRED = ("extract_reasoning", "stream")


def resolve_reasoning_parser(name: str) -> type:
    """The reasoning parser ``name`` (a registered name or a class path). ``UnknownComponentError`` lists the
    registered names for an unknown one; ``PluginLoadError`` names a class that lacks the interface."""
    from vllite.plugin_manager import resolve_component

    parser = resolve_component("reasoning_parsers", name)
    missing = [method for method in REQUIRED if not callable(getattr(parser, method, None))]
    if missing:
        raise PluginLoadError(
            f"Reasoning parser {name!r} ({parser!r}) lacks {', '.join(missing)}: a reasoning parser needs "
            "extract_reasoning(text) and stream() (see vllite.plugins.reasoning.base.ReasoningParser).",
            plugin=name,
        )
    return parser


def reasoning_parser_names() -> list[str]:
    """The registered reasoning-parser names, sorted."""
    from vllite.plugin_manager import get_registry

    return sorted(get_registry("reasoning_parsers"))
