"""Reasoning parsers: split a reasoning model's reply into its reasoning (``reasoning_content``) and its content.

Modules: ``base`` (the interface: ``ReasoningParser``, ``ReasoningStream``), ``markers`` (the marker-delimited
section every builtin uses), ``builtin`` (the families, under vLLM's ``--reasoning-parser`` names), ``registry``
(selecting one by name) and ``plugin`` (registers the builtins through ``vllite_register_reasoning_parsers``, the hook
third parties use too). Layering: imports the kernel only; the server reaches these through the registry.
"""
