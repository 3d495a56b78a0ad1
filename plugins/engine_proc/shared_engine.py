"""Several frontends on one engine process: vLLM's ``--api-server-count N``.

The frontend that starts the engine (API server 0) asks it, through the handshake, to serve
``api_server_count`` clients: besides its own sockets it hands the engine one input and one output address per
other client, IPC paths in its private socket directory that nothing has bound yet (the engine's sockets connect
and queue, ZMQ retries until the path exists). Each other frontend (API server ``i``) is started with
``plugin_config["engine_proc"]["attach"]``: its client binds those two addresses instead of starting an engine, waits
for the engine's announcement (its ``EngineInfo``) on its input socket, and sends every request and utility call
with ``client_index = i``, so the engine routes outputs and answers back to it. An attached client never stops the
engine; it watches the engine process through a pidfd (the engine is not its child).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import zmq

from vllite.config import EngineConfig
from vllite.exceptions import EngineStartupError
from vllite.protocol import EngineInfo

from .utils import PLUGIN_KEY, EndpointFactory, EngineZmqAddresses, make_socket

#: ``plugin_config["engine_proc"]`` keys: how many frontends the engine serves, and (in API servers 1..N-1) which
#: one this is and where it binds.
API_SERVER_COUNT_KEY = "api_server_count"
ATTACH_KEY = "attach"


class AttachInfo(msgspec.Struct, frozen=True):
    """What API server ``client_index`` needs to join the engine that API server 0 started."""

    client_index: int
    input_address: str
    output_address: str
    engine_pid: int


def api_server_count(config: EngineConfig) -> int:
    """The number of frontends the engine serves (``plugin_config["engine_proc"]["api_server_count"]``, default 1)."""
    section = config.plugin_config.get(PLUGIN_KEY) or {}
    count = section.get(API_SERVER_COUNT_KEY) or 1
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"api_server_count must be a positive integer, got {count!r}.")
    return count


def attach_info(config: EngineConfig) -> AttachInfo | None:
    """This frontend's place on a running engine (``plugin_config["engine_proc"]["attach"]``), or None."""
    value = (config.plugin_config.get(PLUGIN_KEY) or {}).get(ATTACH_KEY)
    if value is None or isinstance(value, AttachInfo):
        return value
    return msgspec.convert(value, AttachInfo)


def with_attach(config: EngineConfig, info: AttachInfo) -> EngineConfig:
    """``config`` for API server ``info.client_index``: the same engine, joined instead of started."""
    import dataclasses

    plugin_config = dict(config.plugin_config)
    plugin_config[PLUGIN_KEY] = {**(plugin_config.get(PLUGIN_KEY) or {}), ATTACH_KEY: msgspec.to_builtins(info)}
    return dataclasses.replace(config, plugin_config=plugin_config)


def add_client_addresses(addresses: EngineZmqAddresses, endpoints: EndpointFactory, count: int) -> None:
    """Appends the input and output address of clients ``1 .. count - 1`` (IPC paths bound later, by them)."""
    if count <= 1:
        return
    if endpoints.ipc_dir is None:
        raise ValueError(
            "api_server_count > 1 needs the engine's IPC sockets; unset VLLITE_ENGINE_TCP_HOST "
            "(plugin_config['engine_proc']['tcp_host'])."
        )
    for index in range(1, count):
        addresses.inputs.append(f"ipc://{os.path.join(endpoints.ipc_dir, f'input-{index}')}")
        addresses.outputs.append(f"ipc://{os.path.join(endpoints.ipc_dir, f'output-{index}')}")


def bind_attached(client: Any, info: AttachInfo) -> None:
    """Binds an attached client's sockets at ``info``'s addresses and opens the engine's pidfd (its sentinel)."""
    res = client.resources
    res.ctx = zmq.Context(io_threads=2)
    res.input_socket = make_socket(res.ctx, zmq.ROUTER, linger=0)
    res.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    res.input_socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
    res.output_socket = make_socket(res.ctx, zmq.PULL, linger=0, max_msg_size=client.settings.max_frame_bytes)
    res.input_socket.bind(info.input_address)
    res.output_socket.bind(info.output_address)
    try:
        client.engine_sentinel = os.pidfd_open(info.engine_pid)
    except ProcessLookupError:
        raise EngineStartupError(f"The engine process {info.engine_pid} is gone; API server 0 has stopped.") from None


def wait_attached(client: Any) -> EngineInfo:
    """Waits for the engine's announcement on the attached client's input socket (``VLLITE_ENGINE_READY_TIMEOUT_S``);
    ``EngineStartupError`` when the engine exits or never speaks."""
    res = client.resources
    poller = zmq.Poller()
    poller.register(res.input_socket, zmq.POLLIN)
    poller.register(client.engine_sentinel, zmq.POLLIN)
    deadline = time.monotonic() + client.settings.ready_timeout_s
    while True:
        remaining = deadline - time.monotonic()
        events = dict(poller.poll(timeout=max(0, int(remaining * 1000)))) if remaining > 0 else {}
        if client.engine_sentinel in events:
            raise EngineStartupError("The engine process exited before this API server could join it.")
        if res.input_socket in events:
            identity, payload = res.input_socket.recv_multipart()
            if identity != client.core_engine:
                raise EngineStartupError(f"Unexpected engine identity {identity!r} while joining the engine.")
            return msgspec.msgpack.decode(payload, type=EngineInfo)
        if not events:
            raise EngineStartupError(
                f"The engine did not announce itself to this API server within {client.settings.ready_timeout_s:g} s "
                "(VLLITE_ENGINE_READY_TIMEOUT_S)."
            )
