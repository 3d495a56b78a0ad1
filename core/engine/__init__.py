"""The engine loop and its frontends, as in vLLM V1's ``v1/engine``.

``EngineCore`` (one executor and one scheduler, stepped in-process or by a process wrapper), the engine-core
clients and the in-process client's plugin, ``LLMEngine`` and ``LLM`` (the synchronous user API), and the
frontend parts around them: tokenizer, input processor, incremental detokenizer, output processor, logprobs,
``n > 1`` fan-out. Layering: imports the rest of the kernel (``vllite.config``, ``protocol``, ``sched``,
``kv_cache``, ``logits_processor``, ...) but never ``vllite.plugins`` or ``vllite.policies`` directly;
executors, schedulers and multiprocess clients are reached through the plugin manager's registries. Importing
this package imports no torch.
"""
