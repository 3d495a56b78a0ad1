"""KV-cache events (``vllite.kv_events``, ``--kv-events-config``): a ZMQ subscriber sees ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` batches, in vLLM's ``[topic, seq, payload]`` framing, whose hashes add up to
the engine's prefix cache after a run; the replay socket resends missed batches; bad configs name the field."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from vllite import LLM, SamplingParams
from vllite.engine_args import EngineArgs
from vllite.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    endpoint_for_rank,
)
from vllite.plugins.kv_events.zmq_publisher import decode_batch
from vllite.testing import make_tiny_model_dir_cached

BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drain(sub: zmq.Socket, quiet_s: float = 0.5) -> list[tuple[bytes, int, bytes]]:
    """Every ``[topic, seq, payload]`` message until none came for ``quiet_s``."""
    messages = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        messages.append((topic, int.from_bytes(seq, "big", signed=True), payload))
    return messages


def test_subscriber_sees_the_prefix_cache(monkeypatch):
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "kv@test",
    }
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    model = str(make_tiny_model_dir_cached("llama"))
    # 12 usable blocks: the later prompts evict the earlier prompts' cached blocks.
    llm = LLM(
        model,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=128,
        num_gpu_blocks_override=13,
        kv_events_config=config,
    )
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        prompts = [list(range(100 * i + 1, 100 * i + 1 + 3 * BLOCK + 5)) for i in range(5)]
        for prompt in prompts:
            llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        messages = drain(sub)
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        cached = {block_hash for block_hash, _ in pool.cached_block_hash_to_block.blocks()}

        assert messages and {topic for topic, _, _ in messages} == {b"kv@test"}
        seqs = [seq for _, seq, _ in messages]
        assert seqs == list(range(len(seqs)))
        seen: set[bytes] = set()
        stored = removed = 0
        for _, _, payload in messages:
            batch = decode_batch(payload)
            assert batch.ts > 0
            for event in batch.events:
                if isinstance(event, BlockStored):
                    stored += 1
                    assert event.block_size == BLOCK and len(event.token_ids) == BLOCK * len(event.block_hashes)
                    assert event.lora_id is None and event.medium == "GPU"
                    seen.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    removed += 1
                    assert set(event.block_hashes) <= seen
                    seen.difference_update(event.block_hashes)
        assert stored and removed, "the run should both cache and evict blocks"
        assert seen == cached
        first = next(e for e in decode_batch(messages[0][2]).events if isinstance(e, BlockStored))
        assert first.parent_block_hash is None and first.token_ids == prompts[0][: BLOCK * len(first.block_hashes)]

        # A subscriber that missed batches asks the replay socket from seq 1 on.
        replay = context.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart((b"", (1).to_bytes(8, "big", signed=True)))
        replayed = []
        while replay.poll(5000):
            _, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append((int.from_bytes(seq, "big", signed=True), payload))
        assert replayed == [(seq, payload) for _, seq, payload in messages[1:]]
        replay.close(0)

        assert llm.reset_prefix_cache()
        cleared = [decode_batch(p).events for _, _, p in drain(sub)]
        assert any(isinstance(e, AllBlocksCleared) for events in cleared for e in events)
    finally:
        llm.shutdown()
        sub.close(0)
        context.term()


def test_vllm_wire_shape_and_bad_configs():
    # vLLM's tagged, array-like encoding: [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    # medium, lora_name].
    event = BlockStored([b"h1"], None, [1, 2], 2, None)
    wire = ["BlockStored", [b"h1"], None, [1, 2], 2, None, "GPU", None]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(event)) == wire
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(BlockRemoved([b"h"]))) == ["BlockRemoved", [b"h"], "GPU"]
    assert endpoint_for_rank("tcp://*:5557", 2) == "tcp://*:5559"
    assert endpoint_for_rank("ipc:///tmp/kv", 2) == "ipc:///tmp/kv"
    assert KVEventsConfig.resolve('{"enable_kv_cache_events": true, "publisher": "zmq"}').enabled
    assert not KVEventsConfig.resolve({"enable_kv_cache_events": True}).enabled  # publisher "null"
    for bad, field in (
        ({"publisher": "kafka"}, "publisher"),
        ({"buffer_steps": 0}, "buffer_steps"),
        ({"endpont": "x"}, "endpont"),
        ("[1]", "JSON object"),
        ("{", "JSON"),
    ):
        with pytest.raises(ValueError, match=field):
            EngineArgs(kv_events_config=bad).create_engine_config()


def test_kv_event_sources_route():
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllite.plugins.openai_server.ops.kv_events import kv_event_sources, kv_events_router

    config = KVEventsConfig(True, "zmq", "tcp://*:5557", "tcp://*:5600", topic="kv")
    parallel = SimpleNamespace(data_parallel_size=2)
    ctx = SimpleNamespace(
        engine=SimpleNamespace(config=SimpleNamespace(kv_events_config=config, parallel_config=parallel))
    )
    app = FastAPI()
    app.include_router(kv_events_router(ctx))
    with TestClient(app) as client:
        answer = client.get("/kv_event_sources")
    assert answer.status_code == 200
    sources = answer.json()
    assert [s["data_parallel_rank"] for s in sources] == [0, 1] and {s["topic"] for s in sources} == {"kv"}
    assert sources[0]["endpoint"].endswith(":5557") and sources[1]["endpoint"].endswith(":5558")
    assert sources[1]["replay_endpoint"].endswith(":5601") and "*" not in sources[0]["endpoint"]
    assert kv_event_sources(KVEventsConfig(False, "zmq")) == [] and kv_event_sources(None) == []
    local = KVEventsConfig(True, "zmq", "ipc:///tmp/kv.sock")
    assert kv_event_sources(local) == [
        {"data_parallel_rank": 0, "endpoint": "ipc:///tmp/kv.sock", "replay_endpoint": None, "topic": ""}
    ]
