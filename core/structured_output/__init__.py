"""Structured outputs: constrain a request's output to a JSON schema, a regex, a choice list or a grammar.

``StructuredOutputsParams`` goes on ``SamplingParams.structured_outputs``; ``StructuredOutputsConfig`` holds the
engine's defaults (``--structured-outputs-config``). Grammar backends are plugins
(``vllite_register_structured_output_backends``; builtins ``xgrammar`` and ``guidance``). The engine side is a
:class:`vllite.structured_output.manager.StructuredOutputManagerInterface`, the structured-outputs plugin's.
"""

from vllite.structured_output.params import GrammarSpec, StructuredOutputsConfig, StructuredOutputsParams

__all__ = ["GrammarSpec", "StructuredOutputsConfig", "StructuredOutputsParams"]
