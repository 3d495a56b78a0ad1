"""ZMQ plumbing shared by the engine-core process and its clients: addresses, sockets, settings, handshake structs.

Endpoints are IPC sockets inside a private temporary directory (mode 0700) unless a TCP host is configured
explicitly (``plugin_config["engine_proc"]["tcp_host"]`` or ``VLLITE_ENGINE_TCP_HOST``), in which case every socket
binds to a free port on that host.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from vllite.config import EngineConfig

logger = logging.getLogger(__name__)

PLUGIN_KEY = "engine_proc"
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
#: A fixed one-frame message the engine's output thread sends when it has sent nothing else for a while.
ENGINE_CORE_HEARTBEAT = b"ENGINE_CORE_HEARTBEAT"
DEFAULT_HEARTBEAT_TIMEOUT_S = 60.0
#: The longest interval between two messages from a live engine (heartbeats fill the gaps).
MAX_HEARTBEAT_INTERVAL_S = 1.0
IPC_DIR_PREFIX = "vllite-"
DEFAULT_READY_TIMEOUT_S = 600.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 300.0
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024


def exit_signal_name(exitcode: int | None) -> str | None:
    """The signal that ended a process (``SIGKILL``), from its exit code: negative (killed by it) or ``128 + n`` (the
    engine's own exit on it); None when it exited by itself."""
    if exitcode is None or 0 <= exitcode <= 128:
        return None
    number = -exitcode if exitcode < 0 else exitcode - 128
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def peek_exit_code(proc: Any) -> int | None:
    """``proc.exitcode`` (negative: killed by that signal; ``None``: still running), read without reaping the child.

    Only its owner reaps the engine process (``join`` in ``BackgroundResources``): ``multiprocessing.Process`` is
    not thread-safe, and when a second thread's ``is_alive()`` or ``exitcode`` reaps the child first, the owner's
    ``join`` returns with no exit code at all. ``waitid`` with ``WNOWAIT`` reads the status and leaves the child
    waitable. A process handle without a pid (a Ray actor's) reports its own ``exitcode``."""
    pid = getattr(proc, "pid", None)
    if not isinstance(pid, int) or getattr(proc, "_popen", None) is None:
        return getattr(proc, "exitcode", None)
    try:
        status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped: by its owner, whose Popen keeps the code
        return proc.exitcode
    if status is None:
        return None
    return -status.si_status if status.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else status.si_status


def engine_identity(engine_index: int = 0) -> bytes:
    """The DEALER identity of an engine: its index as 2 little-endian bytes (engine 0 is ``b"\\x00\\x00"``)."""
    return engine_index.to_bytes(2, "little")


class EngineZmqAddresses(msgspec.Struct):
    """Where an engine core connects: one input (client ROUTER) and one output (client PULL) per client."""

    inputs: list[str]
    outputs: list[str]


class EngineHandshakeMetadata(msgspec.Struct):
    """The frontend's answer to HELLO: the data-socket addresses (and config overrides, unused here)."""

    addresses: EngineZmqAddresses
    parallel_config: dict[str, Any] = msgspec.field(default_factory=dict)


class HandshakeStatus(msgspec.Struct):
    """HELLO, READY and FAILED messages on the handshake socket (a FAILED one is a ``HandshakeFailure``)."""

    status: str
    local: bool = True
    headless: bool = False


class HandshakeFailure(msgspec.Struct):
    """What a child that failed to start sends on the handshake socket: FAILED and its start-up error's cause."""

    error: EngineErrorCause
    status: str = "FAILED"


class EngineErrorCause(msgspec.Struct, forbid_unknown_fields=True):
    """A fatal engine exception as a value: its type name and message (the frame after ``ENGINE_CORE_DEAD``)."""

    type: str
    message: str

    @classmethod
    def from_exception(cls, exc: BaseException, limit: int = 2000) -> EngineErrorCause:
        message = str(exc)
        if len(message) > limit:
            message = message[:limit] + "..."
        return cls(type(exc).__name__, message)

    def describe(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


@dataclass
class ProcSettings:
    """Settings of the process engine, from ``config.plugin_config["engine_proc"]`` or the environment."""

    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    shutdown_timeout_s: float = 0.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    tcp_host: str | None = None
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    #: The frontend's CURVE public key (TCP only); set in the engine process from its process arguments.
    curve_server_key: bytes | None = None

    @property
    def heartbeat_interval_s(self) -> float:
        """How often an otherwise silent engine sends a heartbeat: a quarter of the timeout, at most 1 s."""
        return min(MAX_HEARTBEAT_INTERVAL_S, self.heartbeat_timeout_s / 4)

    @classmethod
    def from_config(cls, config: EngineConfig) -> ProcSettings:
        """Plugin config first, then ``VLLITE_ENGINE_READY_TIMEOUT_S``, ``VLLITE_ENGINE_HANDSHAKE_TIMEOUT_S``,
        ``VLLITE_ENGINE_SHUTDOWN_TIMEOUT_S``, ``VLLITE_ENGINE_MAX_FRAME_BYTES``, ``VLLITE_ENGINE_TCP_HOST``,
        ``VLLITE_ENGINE_HEARTBEAT_TIMEOUT_S``."""
        section = dict(config.plugin_config.get(PLUGIN_KEY) or {})

        def pick(key: str, env: str, default: Any, conv: Any) -> Any:
            if key in section and section[key] is not None:
                return conv(section[key])
            raw = os.environ.get(env)
            return conv(raw) if raw not in (None, "") else default

        settings = cls(
            ready_timeout_s=pick("ready_timeout_s", "VLLITE_ENGINE_READY_TIMEOUT_S", DEFAULT_READY_TIMEOUT_S, float),
            handshake_timeout_s=pick(
                "handshake_timeout_s", "VLLITE_ENGINE_HANDSHAKE_TIMEOUT_S", DEFAULT_HANDSHAKE_TIMEOUT_S, float
            ),
            shutdown_timeout_s=pick("shutdown_timeout_s", "VLLITE_ENGINE_SHUTDOWN_TIMEOUT_S", 0.0, float),
            max_frame_bytes=pick("max_frame_bytes", "VLLITE_ENGINE_MAX_FRAME_BYTES", DEFAULT_MAX_FRAME_BYTES, int),
            tcp_host=pick("tcp_host", "VLLITE_ENGINE_TCP_HOST", None, str),
            heartbeat_timeout_s=pick(
                "heartbeat_timeout_s", "VLLITE_ENGINE_HEARTBEAT_TIMEOUT_S", DEFAULT_HEARTBEAT_TIMEOUT_S, float
            ),
        )
        if settings.ready_timeout_s <= 0 or settings.handshake_timeout_s <= 0:
            raise ValueError("Engine ready/handshake timeouts must be > 0 seconds.")
        if settings.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {settings.shutdown_timeout_s}.")
        if settings.heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0 seconds, got {settings.heartbeat_timeout_s}.")
        if settings.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be >= 1024, got {settings.max_frame_bytes}.")
        return settings


def curve_server_keys(tcp_host: str | None) -> tuple[bytes, bytes] | None:
    """A fresh CURVE key pair (public, secret) for TCP endpoints; None for IPC (a 0700 directory protects those)
    or, with a warning, when libzmq was built without CURVE."""
    if not tcp_host:
        return None
    if not zmq.has("curve"):
        logger.warning(
            "libzmq lacks CURVE support: the engine's TCP sockets on %s are NOT authenticated; any local process can "
            "connect to them. Use IPC (no tcp_host) or a libzmq built with libsodium.",
            tcp_host,
        )
        return None
    return zmq.curve_keypair()


class EndpointFactory:
    """Hands out bind addresses: IPC paths in a private 0700 directory, or free TCP ports on a given host."""

    def __init__(self, tcp_host: str | None = None) -> None:
        self.tcp_host = tcp_host
        if not tcp_host:
            sweep_stale_ipc_dirs()
        # The owner's pid is in the name, so a later start can sweep the directory if its owner died by SIGKILL.
        self.ipc_dir: str | None = None if tcp_host else tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")
        if self.ipc_dir is not None:
            os.chmod(self.ipc_dir, 0o700)

    def bind(self, socket: zmq.Socket, name: str) -> str:
        """Binds ``socket`` to a fresh endpoint and returns the address peers must connect to."""
        if self.ipc_dir is not None:
            address = f"ipc://{os.path.join(self.ipc_dir, name)}"
            socket.bind(address)
            return address
        host = self.tcp_host
        assert host is not None  # no IPC directory means a TCP host was given
        bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
        port = socket.bind_to_random_port(f"tcp://{bracketed}")
        return f"tcp://{bracketed}:{port}"

    def cleanup(self) -> None:
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None


def ipc_dir_of(address: str) -> str | None:
    """The private directory of an ``ipc://`` address made by ``EndpointFactory``; None otherwise."""
    if not address.startswith("ipc://"):
        return None
    directory = os.path.dirname(address[len("ipc://") :])
    return directory if os.path.basename(directory).startswith(IPC_DIR_PREFIX) else None


def sweep_stale_ipc_dirs(root: str | None = None) -> None:
    """Removes ``vllite-<pid>-*`` directories (ours by uid) whose owning process no longer exists."""
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) < 3 or parts[0] + "-" != IPC_DIR_PREFIX or not parts[1].isdigit():
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def make_socket(
    ctx: zmq.Context,
    socket_type: int,
    *,
    identity: bytes | None = None,
    linger: int | None = None,
    unlimited_hwm: bool = True,
    max_msg_size: int | None = None,
    curve_server_key: bytes | None = None,
    curve_secret_key: bytes | None = None,
) -> zmq.Socket:
    """A socket with vllite's defaults: no high-water mark on data sockets (nothing is dropped or blocks).

    ``max_msg_size`` (ZMQ's MAXMSGSIZE) refuses a larger frame from its header, before buffering it (the peer is
    disconnected; it reconnects). With CURVE, the binding side is the server (``curve_secret_key``: its secret
    key) and the connecting side the client (``curve_server_key``: the server's public key; a fresh key pair).
    """
    socket = ctx.socket(socket_type)
    if max_msg_size is not None:
        socket.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    if curve_secret_key is not None:
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, curve_secret_key)
    elif curve_server_key is not None:
        public, secret = zmq.curve_keypair()
        socket.setsockopt(zmq.CURVE_SERVERKEY, curve_server_key)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
    if unlimited_hwm:
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity)
    if linger is not None:
        socket.setsockopt(zmq.LINGER, linger)
    return socket
