"""Registers vllite's builtin grammar backends through ``vllite_register_structured_output_backends``, as a third
party would. The backend modules import their libraries only when a backend is built."""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_structured_output_backends(register: Register) -> None:
    """``xgrammar`` (the default: JSON schema, regex, choice, EBNF grammar, structural tag) and ``guidance``
    (llguidance: JSON schema, regex, choice, GBNF/Lark grammar)."""
    register("xgrammar", "vllite.plugins.structured_outputs.xgrammar_backend:XgrammarBackend")
    register("guidance", "vllite.plugins.structured_outputs.guidance_backend:GuidanceBackend")
