"""How the frontend reaches the engine core: the ``EngineCoreClient`` interface, and ``make_client``, which picks one.

Clients are plugins (hook ``vllite_register_engine_clients``). ``make_client`` picks the multiprocess client
(``"mp"``, registered by ``vllite.plugins.engine_proc``) unless ``VLLITE_ENABLE_MULTIPROCESSING=0`` or it is not
available, in which case the in-process client (``"inprocess"``, ``vllite.plugins.inprocess_client``) runs the
engine core in the caller's thread.
"""

from __future__ import annotations

import os
import signal
import threading
from abc import ABC, abstractmethod
from typing import Any

from vllite import deprecated_aliases
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


def __getattr__(name: str) -> object:
    return deprecated_aliases.moved_attribute(__name__, name)
