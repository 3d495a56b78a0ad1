# ruff: noqa: RUF002  (DeepSeek's markers are written with fullwidth bars)
"""The tool-call parsers of the model families people serve, under vLLM's ``--tool-call-parser`` names, registered
(by class path, imported when first used) by the builtin Continuum plugin next to ``tool_parsers.PARSERS``.

| name | family and format |
| --- | --- |
| ``hermes`` | Hermes, Qwen2.5/Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` |
| ``qwen3_coder``, ``qwen3_xml`` | Qwen3-Coder: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>…`` |
| ``mistral`` | Mistral: ``[TOOL_CALLS][{...}]``, ``[TOOL_CALLS]name{...}``, ``[TOOL_CALLS]name[ARGS]{...}`` |
| ``llama3_json``, ``llama4_json`` | Llama 3.x/4: ``{"name": ..., "parameters": {...}}``, ``;``-separated |
| ``deepseek_v3``, ``deepseek_v31`` | DeepSeek-V3/R1/V3.1: ``<｜tool▁calls▁begin｜>…<｜tool▁calls▁end｜>`` |
| ``pythonic`` | Llama 3.2/4 pythonic ``[f(a=1), g(b="x")]`` (vllite's ``llama``) |
| ``granite`` | Granite 3.x: ``<|tool_call|>[{"name": ..., "arguments": {...}}]`` |
| ``openai`` | gpt-oss harmony ``to=functions.NAME`` messages, else OpenAI-style JSON calls |
"""

from __future__ import annotations

FAMILY_PARSERS: dict[str, str] = {
    "qwen3_coder": "vllite.plugins.tool_parsers.xml_parsers:Qwen3CoderParser",
    "qwen3_xml": "vllite.plugins.tool_parsers.xml_parsers:Qwen3CoderParser",
    "mistral": "vllite.plugins.tool_parsers.json_parsers:MistralParser",
    "llama3_json": "vllite.plugins.tool_parsers.json_parsers:Llama3JSONParser",
    "llama4_json": "vllite.plugins.tool_parsers.json_parsers:Llama3JSONParser",
    "granite": "vllite.plugins.tool_parsers.json_parsers:GraniteParser",
    "deepseek_v3": "vllite.plugins.tool_parsers.deepseek:DeepSeekV3Parser",
    "deepseek_v31": "vllite.plugins.tool_parsers.deepseek:DeepSeekV3Parser",
    "pythonic": "vllite.plugins.tool_parsers.parsers:LlamaPythonicParser",
    "openai": "vllite.plugins.tool_parsers.harmony:OpenAIParser",
}
"""vLLM's parser names -> class paths. ``openai`` replaces the JSON-only parser of ``tool_parsers.PARSERS`` (it
still reads those calls)."""
