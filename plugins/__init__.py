"""Default plugins: the heavy parts behind the kernel's contracts, registered through the same hooks a third party
uses (see ``vllite.plugin_manager.BUILTIN_PLUGINS``).

``transformers_executor`` is the default model executor for the CPU and CUDA (transformers models over a paged KV
cache; the executor *interface* is ``vllite.executor``; the old name ``vllite.plugins.executor`` is a deprecated
alias for one release);
``engine_proc`` runs the engine core in its own process behind ZMQ, with its clients and ``AsyncLLM``;
``reasoning`` holds the reasoning parsers (``vllite serve --reasoning-parser``), its interface and builtins;
``vllm_compat`` serves ``vllm.*`` imports to vLLM plugins when no vLLM is installed (the kernel activates it before
it imports any plugin).
Layering: plugins import the kernel (``vllite.*``) and their own dependencies (torch, transformers, zmq), never one
another's internals and never ``vllite.policies``; the kernel reaches them only by registered name. Each
``plugin`` module imports its heavy classes lazily, inside the register hook.
"""
