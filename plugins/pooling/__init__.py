"""Pooling's entry-point side, shared by ``LLM`` and the server: submitting pooling prompts and scoring text pairs.

``llm_api``: what ``LLM.encode`` and ``LLM.score`` run (the kernel's methods keep vLLM's signatures and forward
here); ``scoring``: the pairs, cross-encoder prompts and cosine scores that ``LLM.score`` and the server's
``/score`` and ``/rerank`` share. The pooling requests themselves (``PoolingParams``, their engine requests and
outputs) are the kernel's; the poolers run in the executor plugin.
"""
