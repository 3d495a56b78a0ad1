"""The pooling routes (``/pooling``, ``/classify``, ``/score``, ``/rerank``, ``/v1/embeddings``): ``protocol``,
``prompts`` (inputs to prompts), ``serving`` (the engine calls), ``routes`` (the routers).
"""
