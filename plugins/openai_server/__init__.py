"""The OpenAI-compatible HTTP server (``vllite serve``): FastAPI + uvicorn in front of one ``AsyncLLM``.

Modules: ``plugin`` (registers the ``serve`` command), ``cli`` (flags, start-up, shutdown), ``app`` (the FastAPI
application: routes, auth, errors), ``protocol`` (OpenAI request and response models), ``completions`` and
``chat`` (the two generation routes), ``tool_calls`` (tool-call extraction for chat), ``metrics`` (Prometheus),
``bench`` (``vllite bench serve``, a load generator for any OpenAI-compatible server).
"""
