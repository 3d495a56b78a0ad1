"""KV-cache events for KV-aware routers (vLLM's ``kv_events_config``): what the prefix cache stored and evicted.

The block pool records ``BlockStored`` (a run of full blocks just cached, with their chained hashes, the hash of
the block before them, their tokens, the block size and the LoRA adapter), ``BlockRemoved`` (blocks evicted) and
``AllBlocksCleared`` (the prefix cache reset). Once per engine step the engine core publishes what the step
recorded as one ``KVEventBatch``, a msgpack frame on a ZMQ PUB socket, with vLLM's framing: the multipart message
``[topic, seq, payload]`` (``seq`` an 8-byte big-endian counter). With ``replay_endpoint``, a ROUTER socket serves
the last ``buffer_steps`` batches to a subscriber that missed some: it sends ``seq`` (8 bytes) and gets every kept
batch from that one on as ``[b"", seq, payload]``, then ``[b"", -1, b""]``.

Configure with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557"}'``. The structs are wire-compatible with vLLM's (``vllm.distributed.kv_events``), so a router
built for vLLM decodes them with its own classes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
PUBLISHERS = ("null", "zmq")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped batch of events (``ts``: wall-clock seconds); ``data_parallel_rank`` names the engine."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the KV-cache events; each is tagged with its class name on the wire."""


class BlockStored(KVCacheEvent):
    """Full blocks just cached: ``block_hashes`` in prompt order, chained from ``parent_block_hash`` (``None`` at
    the start of a prompt); ``token_ids`` are their ``len(block_hashes) * block_size`` tokens."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks evicted (their hashes no longer hit)."""

    block_hashes: list[bytes]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


class KVEventBatch(EventBatch):
    """One engine step's KV-cache events."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``kv_events_config``: whether to publish (``enable_kv_cache_events``), how (``publisher``: ``zmq``,
    or ``null`` for nothing), where (``endpoint``, bound by the engine; with data parallel, engine ``r`` binds the
    TCP port plus ``r``), the replay socket (``replay_endpoint``, optional), how many batches it keeps
    (``buffer_steps``), the ZMQ send high-water mark (``hwm``), the in-process queue bound (``max_queue_size``)
    and the ``topic`` every message carries."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}."
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {getattr(self, name)!r}.")

    @property
    def enabled(self) -> bool:
        """Whether events are recorded and published at all."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def resolve(cls, value: Any) -> KVEventsConfig | None:
        """A config from a ``KVEventsConfig``, a dict or JSON text (``None`` stays ``None``); ``ValueError``
        naming the bad field."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not valid JSON: {exc}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(value).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config has unknown field(s) {unknown}; known: {sorted(known)}.")
        return cls(**value)


def endpoint_for_rank(endpoint: str, data_parallel_rank: int) -> str:
    """``endpoint`` for data-parallel engine ``data_parallel_rank``: a TCP port offset by the rank (vLLM's rule)."""
    if data_parallel_rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + data_parallel_rank}"


class ZmqEventPublisher:
    """Publishes ``KVEventBatch``es on a ZMQ PUB socket from a background thread (the engine loop only enqueues),
    and serves replays on an optional ROUTER socket. ``publish`` drops a batch (with a warning) when the queue is
    full rather than stall the engine."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = endpoint_for_rank(config.endpoint, data_parallel_rank)
        replay = config.replay_endpoint
        self.replay_endpoint = endpoint_for_rank(replay, data_parallel_rank) if replay else None
        self.topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._pub.bind(self.endpoint)
            if self.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot bind {self.endpoint!r}: {exc}.") from None
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="vllite-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Any]) -> None:
        """Queues one step's events as a batch (nothing for an empty list)."""
        if not events:
            return
        rank = self.data_parallel_rank if self.data_parallel_rank else None
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning(
                "KV event queue full (%d batches): dropped a batch of %d events", self._queue.maxsize, len(events)
            )

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Sends what is queued, then closes the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)
        self._close_sockets()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                batch = False  # type: ignore[assignment]
            if batch is None:
                return
            if batch:
                payload = self._encoder.encode(batch)
                seq = self._seq.to_bytes(8, "big", signed=True)
                self._pub.send_multipart((self.topic, seq, payload))
                self._buffer.append((self._seq, payload))
                self._seq += 1
            if self._replay is not None and dict(poller.poll(0)):
                self._serve_replay()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        identity, start = frames[0], int.from_bytes(frames[-1], "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big", signed=True), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(0)
        self._context.term()


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> ZmqEventPublisher | None:
    """The publisher ``config`` asks for, bound and running; ``None`` when events are off."""
    if config is None or not config.enabled:
        return None
    return ZmqEventPublisher(config, data_parallel_rank)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A published payload back as a ``KVEventBatch`` (for subscribers and tests)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
