"""How the frontend reaches the engine core: the ``EngineCoreClient`` interface and the in-process client.

Clients are plugins (hook ``vllite_register_engine_clients``). ``make_client`` picks the multiprocess client
(``"mp"``, registered by ``vllite.plugins.engine_proc``) unless ``VLLITE_ENABLE_MULTIPROCESSING=0`` or it is not
available, in which case the in-process client runs the engine core in the caller's thread.
"""

from __future__ import annotations

import os
import signal
import threading
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future
from typing import Any

from vllite.config import EngineConfig
from vllite.protocol import EngineCoreOutputs, EngineCoreRequest, EngineInfo

# Engine-core methods a client may call by name (the process engine refuses everything else over RPC).
UTILITY_METHODS = frozenset(
    {
        "pause_scheduler",
        "resume_scheduler",
        "is_scheduler_paused",
        "reset_prefix_cache",
        "sleep",
        "wake_up",
        "is_sleeping",
        "get_request_counts",
        "get_num_unfinished_requests",
        "get_kv_cache_usage",
        "get_engine_info",
        "add_lora",
        "remove_lora",
        "list_loras",
        "pin_lora",
        "profile",
        "collective_rpc",
    }
)


class EngineCoreClient(ABC):
    """The frontend's handle on an engine core; every call is safe to make from one frontend thread.

    ``engine_info`` is what the engine reported when it started (its limits and the model's facts).
    """

    engine_info: EngineInfo

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a validated request in the engine core."""

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs for this client (in-process: runs one engine step)."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Aborts requests in any state; unknown or finished ids are ignored."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Calls an allow-listed engine-core method by name and returns its result."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the engine core and frees its resources; idempotent."""

    # Convenience wrappers over call_utility, with vLLM's names.
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.call_utility("reset_prefix_cache", reset_running_requests)

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pauses scheduling (``abort``, ``wait`` or ``keep``); returns once the engine is paused."""
        self.call_utility("pause_scheduler", mode, clear_cache)

    def resume_scheduler(self) -> None:
        self.call_utility("resume_scheduler")

    def is_scheduler_paused(self) -> bool:
        return self.call_utility("is_scheduler_paused")

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pauses (``mode``) and frees memory (``level``); returns once the engine sleeps."""
        self.call_utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.call_utility("is_sleeping")

    def add_lora(self, lora_request: Any) -> bool:
        return self.call_utility("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.call_utility("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        return set(self.call_utility("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        return self.call_utility("pin_lora", lora_id)

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Starts or stops the engine's profiler (a stop writes the trace)."""
        self.call_utility("profile", is_start, profile_prefix)

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Calls ``method`` on every worker; the results in worker order (a callable only in-process)."""
        return self.call_utility("collective_rpc", method, timeout, tuple(args), kwargs)


class InprocClient(EngineCoreClient):
    """Runs the engine core in the caller's thread: ``get_output()`` is one engine step.

    A utility call that must wait for the engine (pause ``wait``, sleep) steps it until done, keeping the
    outputs those steps produce for the following ``get_output()`` calls, so nothing is lost or reordered.
    """

    def __init__(self, config: EngineConfig, *, log_stats: bool | None = None) -> None:
        from vllite.engine.core import EngineCore

        self.engine_core = EngineCore(config, log_stats=log_stats)
        govern = getattr(self.engine_core.model_executor, "govern_inprocess_steps", None)
        if govern is not None:  # the engine steps in this thread: its executor may place the model's threads
            try:
                govern(self.engine_core)
            except BaseException:
                self.engine_core.shutdown()
                raise
        self.engine_info = self.engine_core.info
        self._stepped_outputs: deque[EngineCoreOutputs] = deque()
        self._closed = False

    def add_request(self, request: EngineCoreRequest) -> None:
        sigint_deferred(self.engine_core.add_request, request)

    def get_output(self) -> EngineCoreOutputs:
        if self._stepped_outputs:
            return self._stepped_outputs.popleft()
        return self._step()

    def _step(self) -> EngineCoreOutputs:
        outputs, _ = sigint_deferred(self.engine_core.step_fn)  # a Ctrl-C lets the step end: no half-done state
        return (outputs or {}).get(0) or EngineCoreOutputs()

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        if method not in UTILITY_METHODS:
            raise ValueError(
                f"Unknown or disallowed engine utility {method!r}; allowed: {', '.join(sorted(UTILITY_METHODS))}."
            )
        result = getattr(self.engine_core, method)(*args)
        if isinstance(result, Future):
            while not result.done():
                outputs = self._step()
                if outputs.outputs or outputs.finished_requests:
                    self._stepped_outputs.append(outputs)
            return result.result()
        return result

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine_core.shutdown()


def sigint_deferred(fn: Any, *args: Any) -> Any:
    """Calls ``fn(*args)``; a Ctrl-C meanwhile raises ``KeyboardInterrupt`` once it returns (a second one at once)."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler or (
        threading.current_thread() is not threading.main_thread()
    ):
        return fn(*args)
    held: list[Any] = []  # the first Ctrl-C is held, and puts the default handler back for a second one
    signal.signal(signal.SIGINT, lambda signum, _: held.append(signal.signal(signum, signal.default_int_handler)))
    try:
        return fn(*args)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if held:
            raise KeyboardInterrupt


def multiprocessing_enabled() -> bool:
    return os.environ.get("VLLITE_ENABLE_MULTIPROCESSING", "1").strip() not in ("0", "false", "False")


def make_client(
    config: EngineConfig,
    *,
    multiprocess: bool | None = None,
    asyncio_mode: bool = False,
    log_stats: bool | None = None,
) -> EngineCoreClient:
    """Builds the engine client: ``mp`` (or ``async_mp``) when enabled and registered, else in-process; with
    ``data_parallel_size`` > 1, ``dp_<backend>`` (or ``async_dp_<backend>``), and a ``ValueError`` when that backend
    is not registered or multiprocessing is off."""
    from vllite.plugin_manager import get_registry

    clients = get_registry("engine_clients")
    if multiprocess is None:
        multiprocess = multiprocessing_enabled()
    parallel = config.parallel_config
    if parallel.data_parallel_size > 1:
        # Data parallel: clients registered as "dp_<backend>" / "async_dp_<backend>" (mp: vllite.plugins.engine_proc).
        if not multiprocess:
            raise ValueError("data_parallel_size > 1 needs the multiprocess engine (VLLITE_ENABLE_MULTIPROCESSING=1).")
        name = f"{'async_' if asyncio_mode else ''}dp_{parallel.data_parallel_backend}"
        if name not in clients:
            backends = sorted({key.rsplit("dp_", 1)[1] for key in clients if key.startswith(("dp_", "async_dp_"))})
            raise ValueError(
                f"data_parallel_backend {parallel.data_parallel_backend!r} is not available (registered: "
                f"{', '.join(backends) or 'none'}); the ray backend needs `pip install ray`."
            )
        return clients[name](config, log_stats=log_stats)
    name = ("async_mp" if asyncio_mode else "mp") if multiprocess else "inprocess"
    if name not in clients:
        if asyncio_mode:
            raise ValueError("The async engine needs the multiprocess engine-client plugin ('async_mp'), not found.")
        name = "inprocess"
    return clients[name](config, log_stats=log_stats)
