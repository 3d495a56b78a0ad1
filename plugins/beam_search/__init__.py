"""Beam search (vLLM's frontend loop over the engine, not a mode of the model runner).

``search``: the algorithm (:class:`~vllite.plugins.beam_search.search.BeamSearch`), which never talks to an engine;
``offline``: the blocking loop behind ``LLM.beam_search``. The server's ``use_beam_search``
(``vllite.plugins.openai_server.beam_search``) drives the same algorithm with ``await``.
"""
