"""KV-cache events for KV-aware routers (vLLM's ``kv_events_config``): what the prefix cache stored and evicted.

The block pool records ``BlockStored`` (a run of full blocks just cached, with their chained hashes, the hash of
the block before them, their tokens, the block size and the LoRA adapter), ``BlockRemoved`` (blocks evicted) and
``AllBlocksCleared`` (the prefix cache reset). Once per engine step the engine core hands what the step recorded
to the publisher the config names, a plugin (hook ``vllite_register_kv_event_publishers``): the builtin ``zmq``
(``vllite.plugins.kv_events``) sends it as one ``KVEventBatch``, a msgpack frame on a ZMQ PUB socket, with vLLM's
framing, ``[topic, seq, payload]``, and replays missed batches on a ROUTER socket (ending with :data:`END_SEQ`).

Configure with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557"}'``. The structs are wire-compatible with vLLM's (``vllm.distributed.kv_events``), so a router
built for vLLM decodes them with its own classes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec

from vllite import deprecated_aliases

MEDIUM_GPU = "GPU"
#: The ``seq`` frame that ends a replay (vLLM's).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


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
    """vLLM's ``kv_events_config``: whether to publish (``enable_kv_cache_events``), how (``publisher``: a
    registered publisher, ``zmq`` builtin, or a class path; ``null`` for nothing), where (``endpoint``, bound by
    the engine; with data parallel, engine ``r`` binds the TCP port plus ``r``), the replay socket
    (``replay_endpoint``, optional), how many batches it keeps (``buffer_steps``), the ZMQ send high-water mark
    (``hwm``), the in-process queue bound (``max_queue_size``) and the ``topic`` every message carries."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher != "null":
            from vllite.plugin_manager import get_plugin_manager

            try:
                get_plugin_manager().check_name("kv_event_publishers", self.publisher)
            except ValueError as exc:
                raise ValueError(f"kv_events_config.publisher: {exc}") from None
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


def __getattr__(name: str) -> object:
    return deprecated_aliases.moved_attribute(__name__, name)  # the ZMQ publisher's parts, now the kv_events plugin's
