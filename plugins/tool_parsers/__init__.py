"""Tool-call parsers: find the tool calls in a model's reply, whole (``extract``) or as it streams (``stream``).

Modules: ``extraction`` (the interface: ``ExtractedToolCalls``, ``ToolCall``, ``ToolCallStream``), ``scanners``
(the incremental scanners the parsers stream with), ``base`` (``ToolParserBase``, the shared parser), ``parsers``
(``auto``, ``bash``, ``hermes``, ``llama``), the families' formats (``json_parsers``, ``xml_parsers``,
``deepseek``, ``harmony``) under vLLM's ``--tool-call-parser`` names (``families``), and ``plugin`` (registers them
through ``vllite_register_tool_parsers``). Readers: the OpenAI server (``--tool-call-parser``, ``tool_choice``) and
the Continuum scheduler (the tool a turn ends with), both through the registry. Layering: imports the kernel only.
"""
