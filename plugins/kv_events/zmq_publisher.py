"""The ``zmq`` KV-cache event publisher: each engine step's ``KVEventBatch`` as a msgpack frame on a ZMQ PUB socket.

vLLM's framing: the multipart message ``[topic, seq, payload]`` (``seq`` an 8-byte big-endian counter). With
``replay_endpoint``, a ROUTER socket serves the last ``buffer_steps`` batches to a subscriber that missed some: it
sends ``seq`` (8 bytes) and gets every kept batch from that one on as ``[b"", seq, payload]``, then
``[b"", -1, b""]`` (:data:`vllite.kv_events.END_SEQ`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from vllite.kv_events import END_SEQ, KVEventBatch, KVEventsConfig, endpoint_for_rank

logger = logging.getLogger(__name__)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A published payload back as a ``KVEventBatch`` (for subscribers and tests)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


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
