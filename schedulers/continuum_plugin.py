"""The builtin Continuum plugin: registers the ``continuum`` scheduler, the tool-call estimators ``fixed`` and
``utility`` and the tool-call parsers, through the same hooks third parties use."""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_schedulers(register: Register) -> None:
    """Registers ``continuum`` (ContinuumScheduler)."""
    register("continuum", "vllite.policies.continuum:ContinuumScheduler")


@hookimpl
def vllite_register_tool_call_estimators(register: Register) -> None:
    """Registers ``fixed`` (the released fork's 2 s rule) and ``utility`` (the paper's Eq. 2, the default)."""
    register("fixed", "vllite.policies.estimators:FixedTTLEstimator")
    register("utility", "vllite.policies.estimators:UtilityEstimator")


@hookimpl
def vllite_register_tool_parsers(register: Register) -> None:
    """Registers ``auto``, ``bash``, ``hermes`` and ``llama``, and vLLM's family names (``openai``, ``mistral``,
    ``llama3_json``, ``qwen3_coder``, ... see ``tool_parser_families``)."""
    from vllite.policies.tool_parser_families import FAMILY_PARSERS
    from vllite.policies.tool_parsers import PARSERS

    components: dict[str, object] = {**PARSERS, **FAMILY_PARSERS}
    for name, component in components.items():
        register(name, component)
