"""Data parallel with the engine cores as Ray actors (``--data-parallel-backend ray``).

``RayDPClient`` is the data-parallel client (``vllite.plugins.engine_proc.dp_client``) with another way of
starting engines:

1. ``ray.init()`` joins the cluster ``RAY_ADDRESS`` names, or starts a local one (an already initialised Ray is
   used as it is);
2. a placement group reserves one bundle per engine (``--dp-cpus-per-engine`` CPUs, one GPU each where the
   cluster has enough; strategy SPREAD, so engines go to different nodes where they can);
3. for each engine the client binds its input (ROUTER) and output (PULL) sockets on TCP on this node's address
   (CURVE-authenticated where libzmq supports it), then creates the actor in its bundle with those addresses —
   no handshake (vLLM's ``EngineCoreActorMixin``) — and starts its busy loop (``run()``);
4. a watcher thread per engine waits on ``run()``: when it ends (a shutdown, a crash, ``ray.kill``, a dead node)
   the actor is killed and the engine's death pipe closes, which its output thread reads as it reads a process
   sentinel — the engine's requests fail with ``EngineDeadError`` and the others go on.

Shutdown asks every actor to stop, waits, kills what is left, and removes the placement group: no actor or
socket remains. Lockstep waves (``--dp-lockstep``) need the local backend.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from vllite.config import EngineConfig
from vllite.exceptions import EngineStartupError
from vllite.plugins.engine_proc.client import _PASSED_ENV_PREFIXES
from vllite.plugins.engine_proc.dp_client import AsyncDPClient, DPClient, SyncDPClient
from vllite.plugins.engine_proc.dp_engines import DPEngineClient, Sink, stop_engines
from vllite.plugins.engine_proc.utils import EndpointFactory, EngineZmqAddresses, curve_server_keys, make_socket

logger = logging.getLogger(__name__)


class RayActorProcess:
    """A Ray actor seen through the ``multiprocessing.Process`` interface the engine client uses: ``sentinel`` (a
    pipe that closes when the actor's ``run()`` ends), ``is_alive``, ``terminate`` (graceful), ``kill``, ``join``."""

    def __init__(self, actor: Any, info: dict[str, Any], resources: Any = None) -> None:
        self.actor = actor
        self._resources = resources  # the engine client's BackgroundResources: told why the actor died
        self.pid: int = info["pid"]
        self.node_id: str = info["node_id"]
        self.exitcode: int | None = None
        self._done = threading.Event()
        self.sentinel, self._write_fd = os.pipe()
        self._run_ref: Any = None

    def start(self) -> None:
        """Starts the busy loop and the thread that watches it."""
        self._run_ref = self.actor.run.remote()
        threading.Thread(target=self._watch, name="VLLiteRayEngineWatch", daemon=True).start()

    def _watch(self) -> None:
        import ray

        try:
            ray.get(self._run_ref)
            self.exitcode = 0
        except BaseException as exc:  # the actor died (killed, its node lost, out of memory) or its loop raised
            self.exitcode = 1
            resources = self._resources
            if resources is not None and not resources.closed:
                resources.mark_dead(f"The engine actor died: {type(exc).__name__}: {exc}")
        finally:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:
                pass
            self._done.set()
            os.close(self._write_fd)

    def is_alive(self) -> bool:
        """Whether the actor's busy loop is still running."""
        return self._run_ref is not None and not self._done.is_set()

    def terminate(self) -> None:
        """Asks the engine to shut down (it drains for its shutdown timeout)."""
        try:
            self.actor.request_shutdown.remote()
        except Exception:
            self.kill()

    def kill(self) -> None:
        """Kills the actor at once."""
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass

    def join(self, timeout: float | None = None) -> None:
        """Waits until the actor's loop has ended and the actor is gone."""
        self._done.wait(timeout)

    def close(self) -> None:
        """Closes the death pipe's read end (once nothing polls it any more)."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class RayEngineClient(DPEngineClient):
    """One engine core as a Ray actor in bundle ``engine_index`` of ``placement_group``."""

    def __init__(self, config: EngineConfig, sink: Sink, *, placement_group: Any, bundle_resources: dict, **kwargs):
        self._placement_group = placement_group
        self._bundle_resources = bundle_resources
        super().__init__(config, sink, deferred=True, **kwargs)

    def start_engine(self) -> None:
        """Binds the sockets on this node's TCP address and creates the actor with their addresses."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .actor import EngineCoreActor

        log_stats, _, env_overrides = self._launch_args
        res = self.resources
        host = self.settings.tcp_host or ray.util.get_node_ip_address()
        res.ctx = zmq.Context(io_threads=2)
        res.endpoints = endpoints = EndpointFactory(host)
        keys = curve_server_keys(host)
        secret = keys[1] if keys is not None else None
        res.input_socket = make_socket(res.ctx, zmq.ROUTER, linger=0, curve_secret_key=secret)
        res.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        res.input_socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        res.output_socket = make_socket(
            res.ctx, zmq.PULL, linger=0, max_msg_size=self.settings.max_frame_bytes, curve_secret_key=secret
        )
        self._addresses = EngineZmqAddresses(
            inputs=[endpoints.bind(res.input_socket, "input")], outputs=[endpoints.bind(res.output_socket, "output")]
        )
        env = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ENV_PREFIXES)}
        env.update(env_overrides)
        strategy = PlacementGroupSchedulingStrategy(
            self._placement_group, placement_group_bundle_index=self.engine_index
        )
        actor_class = ray.remote(EngineCoreActor).options(
            name=None,
            max_concurrency=2,  # run() and request_shutdown() at once
            num_cpus=self._bundle_resources.get("CPU", 0),
            num_gpus=self._bundle_resources.get("GPU", 0),
            scheduling_strategy=strategy,
            max_restarts=0,
        )
        self._actor: Any = actor_class.remote(
            self.config,
            self._addresses,
            self.engine_index,
            env,
            list(sys.path),
            keys[0] if keys is not None else None,
            log_stats,
        )

    def wait_until_ready(self) -> None:
        """Waits for the actor's ``__init__`` and the engine's announcement, then starts its loop and the output
        thread; ``EngineStartupError`` names the cause if the actor fails."""
        import ray

        deadline = time.monotonic() + self.settings.ready_timeout_s
        try:
            info: dict[str, Any] = ray.get(self._actor.wait_for_init.remote(), timeout=self.settings.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise EngineStartupError(
                f"Engine actor {self.engine_index} was not ready within {self.settings.ready_timeout_s:g} s "
                "(VLLITE_ENGINE_READY_TIMEOUT_S); does the cluster have the resources of its bundle?"
            ) from None
        except ray.exceptions.RayError as exc:
            raise EngineStartupError(f"Engine actor {self.engine_index} failed to start: {exc}") from None
        proc = RayActorProcess(self._actor, info, self.resources)
        self.resources.proc = proc
        input_socket = self.resources.input_socket
        assert input_socket is not None
        if not input_socket.poll(timeout=max(0, int((deadline - time.monotonic()) * 1000))):
            raise EngineStartupError(f"Engine actor {self.engine_index} started but never announced itself.")
        import msgspec

        from vllite.protocol import EngineInfo

        identity, payload = input_socket.recv_multipart()
        if identity != self.core_engine:
            raise EngineStartupError(f"Unexpected engine identity {identity!r} during start-up.")
        self.engine_info = msgspec.msgpack.decode(payload, type=EngineInfo)
        proc.start()
        self._start_output_thread()

    def shutdown(self) -> None:
        """Stops the actor (as the process client stops its process) and closes the death pipe."""
        super().shutdown()
        proc = self.resources.proc
        if isinstance(proc, RayActorProcess):
            proc.close()

    @property
    def node_id(self) -> str:
        """The Ray node the actor runs on."""
        return self.resources.proc.node_id


class RayDPClient(DPClient):
    """The data-parallel client with Ray actors as engines (see the module docstring)."""

    placement_group: Any = None

    def _start_engines(
        self, config: EngineConfig, sinks: Sequence[Sink], log_stats: bool | None, executor_class: type | None
    ) -> list[Any]:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        if config.parallel_config.dp_lockstep:
            raise ValueError("dp_lockstep needs data_parallel_backend='mp' (local engine processes).")
        if executor_class is not None:
            raise ValueError("The Ray backend builds each engine's executor from the config (executor=...).")
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=False)
        cpus = float(config.parallel_config.dp_cpus_per_engine)
        bundle: dict[str, float] = {"CPU": cpus}
        if _wants_gpu(config) and ray.cluster_resources().get("GPU", 0) >= len(sinks):
            bundle["GPU"] = 1
        self.placement_group = pg = placement_group([dict(bundle)] * len(sinks), strategy="SPREAD")
        ready_timeout_s = float(os.environ.get("VLLITE_ENGINE_READY_TIMEOUT_S", "600"))
        try:
            if not pg.wait(timeout_seconds=ready_timeout_s):
                raise EngineStartupError(
                    f"The Ray cluster cannot place {len(sinks)} engines of {bundle} each "
                    f"(available: {ray.available_resources()})."
                )
            env = {"VLLITE_CPU_OMP_THREADS_BIND": os.environ.get("VLLITE_CPU_OMP_THREADS_BIND", "nobind")}
            env.setdefault("VLLITE_CPU_NUM_THREADS", os.environ.get("VLLITE_CPU_NUM_THREADS", str(max(1, int(cpus)))))
            engines = [
                RayEngineClient(
                    _with_rank(config, rank),
                    sink,
                    placement_group=pg,
                    bundle_resources=bundle,
                    log_stats=log_stats,
                    engine_index=rank,
                    env_overrides=env,
                )
                for rank, sink in enumerate(sinks)
            ]
            rank = 0
            try:
                for engine in engines:
                    engine.start_engine()
                for engine in engines:
                    rank = engine.engine_index
                    engine.wait_until_ready()
            except BaseException as exc:
                stop_engines(engines)
                if isinstance(exc, EngineStartupError):
                    raise
                raise EngineStartupError(
                    f"Data-parallel engine actor {rank} (of {len(engines)}) failed to start: {exc}"
                ) from exc
        except BaseException:
            remove_placement_group(pg)
            self.placement_group = None
            raise
        return engines

    def shutdown(self) -> None:
        """Stops every actor and removes the placement group."""
        super().shutdown()
        pg, self.placement_group = self.placement_group, None
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)


def _with_rank(config: EngineConfig, rank: int) -> EngineConfig:
    from vllite.plugins.engine_proc.dp_engines import engine_config

    return engine_config(config, rank)


def _wants_gpu(config: EngineConfig) -> bool:
    return config.device_config.device in ("auto", "cuda")


class SyncRayDPClient(RayDPClient, SyncDPClient):
    """``LLM``'s data-parallel client on Ray actors."""


class AsyncRayDPClient(RayDPClient, AsyncDPClient):
    """``AsyncLLM``'s data-parallel client on Ray actors."""
