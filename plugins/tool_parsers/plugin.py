"""The builtin tool-call parser plugin: registers the parsers through ``vllite_register_tool_parsers``, the hook
third parties use too."""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_tool_parsers(register: Register) -> None:
    """Registers ``auto``, ``bash``, ``hermes`` and ``llama``, and vLLM's family names (``openai``, ``mistral``,
    ``llama3_json``, ``qwen3_coder``, ... see ``families``)."""
    from vllite.plugins.tool_parsers.families import FAMILY_PARSERS
    from vllite.plugins.tool_parsers.parsers import PARSERS

    components: dict[str, object] = {**PARSERS, **FAMILY_PARSERS}
    for name, component in components.items():
        register(name, component)
