"""The OpenAI-compatible HTTP server (``vllite serve``): FastAPI + uvicorn in front of one ``AsyncLLM``.

Modules:

- the command: ``plugin`` (registers ``serve``), ``cli`` (flags, start-up, graceful shutdown);
- the application: ``app`` (routes, auth), ``context`` (what routes share), ``errors`` (OpenAI error objects),
  ``event_stream`` (Server-Sent Events that notice a disconnect);
- the API: ``protocol`` (request models, pydantic), ``responses`` (response structs, msgspec), ``sampling``
  (request to ``SamplingParams``), ``streams`` (submitting and reading engine requests), ``completions`` and
  ``chat`` (the two generation routes), ``chat_template``, ``tool_choice`` (tool calling), ``reasoning`` (the
  reasoning split and its engine arguments), ``parser_plugins`` (``--tool-parser-plugin``), ``logprobs``;
- ``metrics`` (the Prometheus stat logger);
- ``vllite bench serve``, a load generator for any OpenAI-compatible server: ``bench`` (the run), ``bench_config``
  (flags), ``bench_client`` (one streamed request), ``bench_requests`` (prompts, arrivals), ``bench_metrics``.
"""
