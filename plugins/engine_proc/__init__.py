"""The multiprocess engine core: ``EngineCoreProc`` (``EngineCore`` in a child process, with input and output
threads over ZMQ and msgpack), the ``mp`` / ``async_mp`` clients that talk to it, and ``AsyncLLM``.

Registered by ``plugin`` as the engine clients ``mp`` and ``async_mp`` (imported lazily, so loading the plugin
imports neither zmq nor torch). Layering: imports the kernel (``vllite.engine``, ``vllite.protocol``,
``vllite.config``, the CPU-thread plan of ``vllite.platform.cpu_threads``, ...), zmq and its own wire encoding
(``serial``); the executor it hosts places its own threads (``Executor.govern_process_steps``); nothing in the kernel
imports this package except through the engine-client registry (and ``vllite.AsyncLLM``'s lazy attribute).
"""
