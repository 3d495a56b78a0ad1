"""The multiprocess engine core: ``EngineCoreProc`` (``EngineCore`` in a child process, with input and output
threads over ZMQ and msgpack), the ``mp`` / ``async_mp`` clients that talk to it, and ``AsyncLLM``.

Registered by ``plugin`` as the engine clients ``mp`` and ``async_mp`` (imported lazily, so loading the plugin
imports neither zmq nor torch). Layering: imports the kernel (``vllite.engine``, ``vllite.protocol``,
``vllite.config``, ...), zmq, its own wire encoding (``serial``) and, to place the threads of the executor it hosts,
``vllite.plugins.transformers_executor.cpu_threads`` / ``cpu_governor``; nothing in the kernel imports this package
except through the engine-client registry (and ``vllite.AsyncLLM``'s lazy attribute).
"""
