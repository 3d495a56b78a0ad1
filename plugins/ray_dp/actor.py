"""``EngineCoreActor``: one data-parallel engine core as a Ray actor (vLLM's ``EngineCoreActorMixin``).

There is no ZMQ handshake: the client binds its sockets first and gives the actor their addresses when it creates
it, so ``_perform_handshake`` yields them without a socket and sends no READY. The engine announces itself (its
``EngineInfo``) on the input socket as in the process backend; ``wait_for_init()`` returning means ``__init__``
finished. ``run()`` is the busy loop; it returns after a shutdown (``request_shutdown()``, called concurrently:
the actor runs two threads) and always shuts the engine down.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllite.config import EngineConfig
from vllite.plugins.engine_proc.dp_core_proc import DPEngineCoreProc
from vllite.plugins.engine_proc.utils import EngineZmqAddresses

logger = logging.getLogger(__name__)


class PresetAddressesEngineCoreProc(DPEngineCoreProc):
    """A DP engine core whose client addresses are given up front (no handshake socket, no READY)."""

    def __init__(self, config: EngineConfig, addresses: EngineZmqAddresses, **kwargs: Any) -> None:
        self._preset_addresses = addresses
        super().__init__(config, "", **kwargs)

    @contextmanager
    def _perform_handshake(self, handshake_address: str, identity: bytes) -> Iterator[EngineZmqAddresses]:
        yield self._preset_addresses


class EngineCoreActor:
    """The Ray actor (decorated with ``ray.remote`` by the client): builds the engine in ``__init__``."""

    def __init__(
        self,
        config: EngineConfig,
        addresses: EngineZmqAddresses,
        engine_index: int,
        env: dict[str, str],
        sys_path: list[str],
        curve_server_key: bytes | None = None,
        log_stats: bool | None = None,
    ) -> None:
        for entry in reversed(sys_path):
            if entry not in sys.path:
                sys.path.append(entry)
        os.environ.update(env)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [EngineCoreActor] %(message)s")
        from vllite.platform.cpu_threads import resolve_plan

        plan = resolve_plan()
        for key, value in plan.spawn_env().items():
            os.environ.setdefault(key, value)
        self.engine_index = engine_index
        self.proc = PresetAddressesEngineCoreProc(
            config,
            addresses,
            engine_index=engine_index,
            curve_server_key=curve_server_key,
            log_stats=log_stats,
            cpu_plan=plan,
        )

    def wait_for_init(self) -> dict[str, Any]:
        """Returns once ``__init__`` has finished: where the actor runs (pid, host, Ray node)."""
        import ray

        return {"pid": os.getpid(), "host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id()}

    def run(self) -> int:
        """The busy loop, until shutdown; a fatal error tells the client (ENGINE_CORE_DEAD) and is re-raised."""
        try:
            self.proc.run_busy_loop()
        except SystemExit:
            self.proc.stop_output_thread()
            return 0
        except BaseException as exc:
            logger.exception("EngineCoreActor %d encountered a fatal error.", self.engine_index)
            self.proc.send_engine_dead(exc)
            raise
        finally:
            self.proc.shutdown()
        return 0

    def request_shutdown(self, drain_timeout_s: float | None = None) -> None:
        """RUNNING → REQUESTED (the busy loop drains for ``drain_timeout_s``, then ``run()`` returns)."""
        self.proc.request_shutdown(drain_timeout_s)
