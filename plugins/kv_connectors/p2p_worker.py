"""The worker half of the ``p2p`` connector: KV blocks served and fetched over ZMQ.

Producer: a ROUTER socket bound at ``tcp://host:port`` (port 0: a free one) is served by a background thread.
``offer`` registers a finished request's blocks under a transfer id; a consumer's fetch (``{"transfer_id",
"start", "end"}``) is answered with a JSON header and the blocks ``[start, end)`` as one
``[layers, 2, n, block_size, heads, dim]`` tensor, read from the paged cache (the scheduler keeps those blocks
allocated until the request is reported in ``take_sent``). A transfer nobody fetches within ``send_timeout_s`` is
dropped and reported sent, so its blocks are freed.

Consumer: ``fetch`` pulls one request's blocks on a background thread (a REQ socket, ``timeout_s``) and copies
them into the request's allocated blocks; an unreachable producer, a timeout or a bad reply makes every block of
the load a load error. Either way the request is reported in ``loads.take_finished``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from vllite.plugins.kv_connectors.background_loads import BackgroundLoads
from vllite.plugins.kv_connectors.errors import P2PTransferError

logger = logging.getLogger(__name__)


@dataclass
class P2PLoad:
    """Fetch blocks ``[start, start + len(block_ids))`` of ``transfer_id`` from ``address`` into ``block_ids``."""

    req_id: str
    address: str
    transfer_id: str
    start: int
    block_ids: list[int]


@dataclass
class P2PSend:
    """Serve the blocks ``block_ids`` of finished request ``req_id`` under ``transfer_id``."""

    req_id: str
    transfer_id: str
    block_ids: list[int]


class P2PWorker:
    """The paged-cache tensors, the producer's server thread and the consumer's fetch threads."""

    def __init__(self, host: str, port: int, timeout_s: float, send_timeout_s: float, serve: bool) -> None:
        self.timeout_s = timeout_s
        self.send_timeout_s = send_timeout_s
        self.layers: list[torch.Tensor] = []
        self._ctx = zmq.Context()
        self._lock = threading.Lock()  # guards _offers and _sent (the server thread writes them)
        self._offers: dict[str, tuple[P2PSend, float]] = {}  # transfer id -> (send, deadline)
        self._sent: set[str] = set()
        self._stop = threading.Event()
        self.loads = BackgroundLoads(max_workers=2, thread_name_prefix="vllite-kv-p2p-fetch")  # the fetch threads
        self.num_blocks_sent = 0
        self.address: str | None = None
        self._server: threading.Thread | None = None
        if serve:
            socket = self._ctx.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            if port:
                socket.bind(f"tcp://{host}:{port}")
            else:
                port = socket.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"
            self._server = threading.Thread(target=self._serve, args=(socket,), name="vllite-kv-p2p-serve", daemon=True)
            self._server.start()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Layer name -> ``[2, num_blocks, block_size, heads, dim]``; the dict's order is the layer order."""
        self.layers = list(kv_caches.values())

    # ------------------------------------------------------------------ producer
    def offer(self, sends: list[P2PSend]) -> None:
        """Makes the blocks of ``sends`` fetchable until fetched or ``send_timeout_s`` passes (0: released at
        once, nothing can fetch them)."""
        deadline = time.monotonic() + self.send_timeout_s
        with self._lock:
            for send in sends:
                if self.send_timeout_s <= 0:
                    self._sent.add(send.req_id)
                    continue
                self._offers[send.transfer_id] = (send, deadline)

    def _serve(self, socket: zmq.Socket[bytes]) -> None:
        """The server thread: answers fetches and expires unfetched offers until shutdown."""
        try:
            while not self._stop.is_set():
                if socket.poll(100, zmq.POLLIN):
                    ident, _, payload = socket.recv_multipart()
                    socket.send_multipart([ident, b"", *self._answer(payload)])
                self._expire()
        finally:
            socket.close(0)

    def _answer(self, payload: bytes) -> list[bytes]:
        """``[header, data]`` for one fetch; the transfer is then reported sent."""
        try:
            ask = json.loads(payload)
            with self._lock:
                entry = self._offers.pop(str(ask["transfer_id"]), None)
            if entry is None:
                return [json.dumps({"ok": False, "error": "unknown transfer id"}).encode(), b""]
            send = entry[0]
            try:
                ids = send.block_ids[int(ask["start"]) : int(ask["end"])]
                index = torch.tensor(ids, dtype=torch.int64, device=self.layers[0].device)
                kv = torch.stack([layer.index_select(1, index) for layer in self.layers]).cpu().contiguous()
            finally:
                with self._lock:
                    self._sent.add(send.req_id)
            header = {"ok": True, "shape": list(kv.shape), "dtype": str(kv.dtype).removeprefix("torch.")}
            self.num_blocks_sent += len(ids)
            return [json.dumps(header).encode(), kv.view(torch.uint8).numpy().tobytes()]
        except Exception as exc:  # a bad fetch must not stop the server
            logger.exception("p2p: answering a fetch failed")
            return [json.dumps({"ok": False, "error": str(exc)}).encode(), b""]

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for transfer_id, (send, deadline) in list(self._offers.items()):
                if deadline < now:
                    logger.warning("p2p: request %s's KV was not fetched in time; releasing it", send.req_id)
                    del self._offers[transfer_id]
                    self._sent.add(send.req_id)

    def take_sent(self) -> set[str]:
        """Requests whose blocks were fetched (or expired) since the previous call."""
        with self._lock:
            sent, self._sent = self._sent, set()
        return sent

    # ------------------------------------------------------------------ consumer
    def fetch(self, loads: list[P2PLoad]) -> None:
        """Starts pulling ``loads`` in the background."""
        for load in loads:
            self.loads.submit(self._pull, load)

    def _pull(self, load: P2PLoad) -> None:
        """The fetch thread: one request's blocks from the producer into the paged cache, or load errors."""
        failed: set[int] = set()
        try:
            kv = self._request(load)
            if kv.shape[2] != len(load.block_ids):
                raise P2PTransferError(f"got {kv.shape[2]} blocks, expected {len(load.block_ids)}")
            device = self.layers[0].device
            ids = torch.tensor(load.block_ids, dtype=torch.int64, device=device)
            kv = kv.to(device)
            for index, layer in enumerate(self.layers):
                layer.index_copy_(1, ids, kv[index].to(layer.dtype))
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        except Exception as exc:  # never a hang: every failure is a load error
            logger.warning("p2p: loading request %s's KV from %s failed: %s", load.req_id, load.address, exc)
            failed = set(load.block_ids)
        self.loads.finish(load.req_id, len(load.block_ids) - len(failed), failed)

    def _request(self, load: P2PLoad) -> torch.Tensor:
        """One fetch round trip; ``P2PTransferError`` on a timeout or a refusal."""
        socket = self._ctx.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(load.address)
            ask = {"transfer_id": load.transfer_id, "start": load.start, "end": load.start + len(load.block_ids)}
            socket.send(json.dumps(ask).encode())
            if not socket.poll(int(self.timeout_s * 1000), zmq.POLLIN):
                raise P2PTransferError(f"no answer within {self.timeout_s} s")
            header_bytes, data = socket.recv_multipart()
        finally:
            socket.close(0)
        header = json.loads(header_bytes)
        if not header.get("ok"):
            raise P2PTransferError(f"the producer refused: {header.get('error')}")
        dtype = getattr(torch, str(header["dtype"]))
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return raw.view(dtype).reshape(header["shape"])

    def shutdown(self) -> None:
        """Stops the server thread, waits for fetches in flight, closes the sockets."""
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=5)
        self.loads.shutdown()
        self._ctx.term()
