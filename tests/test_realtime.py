"""``/v1/realtime`` through the official ``openai`` client's realtime connection, against real in-process servers on
the tiny llama model: a 5-turn session equal (text and usage) to an oracle that sends the whole history as one greedy
prompt, each later turn prefilling only its new tokens; error events (invalid JSON, unknown event, bad parameters, a
second ``response.create`` during a response) that leave the session and the other connections going;
``response.cancel``; the API key on the handshake; a client that leaves mid-turn frees the session's KV.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("websockets")

from vllite import SamplingParams  # noqa: E402
from vllite.plugins.openai_server.context import ServerSettings  # noqa: E402

KEY = "realtime-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256
INSTRUCTIONS = "You answer briefly."
CHUNKS = ["Hello there, my friend", " and then", " what about", " the end", " really"]
TIMEOUT_S = 60.0


# ------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def servers():
    from inprocess_servers import InProcessServers

    from vllite.engine_args import EngineArgs
    from vllite.testing import make_tiny_model_dir_cached

    engine_args = EngineArgs(
        model=str(make_tiny_model_dir_cached("llama")), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8
    )
    settings = {
        "open": ServerSettings(served_model_names=(MODEL,)),
        "keyed": ServerSettings(served_model_names=(MODEL,), api_key=KEY),
    }
    harness = InProcessServers(engine_args, settings)
    try:
        _include_realtime(harness)
        yield harness
    finally:
        harness.close()


def _include_realtime(harness: Any) -> None:
    """Adds ``/v1/realtime`` to each app unless ``build_app`` already serves it."""
    from vllite.plugins.openai_server.realtime.session import realtime_router

    for server, ctx in zip(harness.servers, harness.contexts.values()):
        app = server.config.app
        if not any(getattr(route, "path", None) == "/v1/realtime" for route in app.routes):
            app.include_router(realtime_router(ctx))


def client(servers, name: str = "open", api_key: str = "unused") -> Any:
    return openai.AsyncOpenAI(base_url=servers.urls[name], api_key=api_key, max_retries=0)


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S * 3))


# ------------------------------------------------------------------------------------------------- helpers


async def recv(conn: Any) -> Any:
    return await asyncio.wait_for(conn.recv(), TIMEOUT_S)


async def add_text(conn: Any, text: str, role: str = "user") -> None:
    await conn.conversation.item.create(item={"type": "message", "role": role, "content": [_text(text)]})


def _text(text: str) -> dict[str, str]:
    return {"type": "input_text", "text": text}


async def until(conn: Any, kind: str) -> list[Any]:
    """Every event up to and including the first of type ``kind``."""
    events = []
    while True:
        event = await recv(conn)
        events.append(event)
        if event.type == kind:
            return events


async def turn(conn: Any, text: str | None, **response: Any) -> list[Any]:
    """Adds ``text`` (if any), creates a response, and returns the events up to its ``response.done``."""
    if text is not None:
        await add_text(conn, text)
    await conn.response.create(response=response)
    return await until(conn, "response.done")


def kv_usage(servers) -> float:
    return servers.call(servers.engine.call_utility("get_kv_cache_usage"))


def wait_kv_free(servers, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while kv_usage(servers) > 0.0:
        assert time.monotonic() < deadline, f"KV still in use: {kv_usage(servers)}"
        time.sleep(0.1)
    assert tuple(servers.call(servers.engine.call_utility("get_request_counts"))) == (0, 0)


def greedy(servers, prompt_token_ids: list[int], max_tokens: int, request_id: str) -> Any:
    """The oracle: the whole history as one prompt, greedy, on the same engine."""

    async def generate() -> Any:
        final = None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        async for output in servers.engine.generate({"prompt_token_ids": prompt_token_ids}, params, request_id):
            final = output
        return final.outputs[0]

    return servers.call(generate())


# ------------------------------------------------------------------------------------------------- tests


def test_five_turns_equal_one_prompt_oracle_and_prefill_only_new_tokens(servers):
    tokenizer = servers.engine.tokenizer
    turns: list[list[Any]] = []

    async def session() -> None:
        async with client(servers).realtime.connect(model=MODEL) as conn:
            created = await recv(conn)
            assert created.type == "session.created" and created.session.model == MODEL
            await conn.session.update(session={"type": "realtime", "instructions": INSTRUCTIONS, "temperature": 0.0})
            updated = await recv(conn)
            assert updated.type == "session.updated" and updated.session.instructions == INSTRUCTIONS
            for index, chunk in enumerate(CHUNKS):
                turns.append(await turn(conn, chunk, max_output_tokens=4 + index))
            assert kv_usage(servers) > 0.0  # the parked session holds its KV between turns

    run(session())
    context: list[int] = []
    previous_item = None
    for index, (chunk, events) in enumerate(zip(CHUNKS, turns)):
        kinds = [event.type for event in events]
        deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
        assert kinds[:6] == [
            "conversation.item.added",  # the user's item
            "conversation.item.done",
            "response.created",
            "response.output_item.added",
            "conversation.item.added",  # the assistant's item
            "response.content_part.added",
        ]
        assert kinds[6 + len(deltas) :] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "conversation.item.done",
            "response.done",
        ]
        user_item = events[0].item
        assert events[0].previous_item_id == previous_item and user_item.content[0].text == chunk
        assert events[4].previous_item_id == user_item.id
        previous_item = events[4].item.id

        text = INSTRUCTIONS + "\n\n" + chunk if index == 0 else chunk
        chunk_ids = tokenizer.encode(text, add_special_tokens=index == 0)
        prompt = context + chunk_ids
        expected = greedy(servers, prompt, 4 + index, f"oracle-{index}")
        done = events[-1].response
        assert "".join(deltas) == expected.text == events[-5].text
        assert done.output[0].content[0].text == expected.text
        assert done.status == ("incomplete" if expected.finish_reason == "length" else "completed")
        assert done.usage.input_tokens == len(prompt)
        assert done.usage.output_tokens == len(expected.token_ids)
        cached = done.usage.input_token_details.cached_tokens
        if index:
            # the session's KV covers everything but the previous turn's last token, which has none yet
            assert done.usage.input_tokens - cached == len(chunk_ids) + 1
        context = prompt + list(expected.token_ids)
    wait_kv_free(servers)  # the connection closed: the session is gone


def test_errors_are_events_and_the_session_goes_on(servers):
    async def session() -> None:
        async with (
            client(servers).realtime.connect(model=MODEL) as conn,
            client(servers).realtime.connect(model=MODEL) as other,
        ):
            assert (await recv(conn)).type == "session.created"
            assert (await recv(other)).type == "session.created"
            await conn.session.update(session={"type": "realtime", "temperature": 0.0})
            assert (await recv(conn)).type == "session.updated"

            await conn.send_raw("{not json")
            error = await recv(conn)
            assert error.type == "error" and error.error.code == "invalid_json"

            await conn.send_raw(json.dumps({"type": "input_audio_buffer.append", "audio": "", "event_id": "e1"}))
            error = await recv(conn)
            assert (error.error.code, error.error.param, error.error.event_id) == ("unknown_event_type", "type", "e1")

            await conn.session.update(session={"type": "realtime", "max_output_tokens": 0}, event_id="e2")
            error = await recv(conn)
            assert error.error.code == "invalid_value" and error.error.param == "session.max_output_tokens"
            assert error.error.event_id == "e2"

            audio = {"type": "input_audio", "audio": ""}
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [audio]})
            error = await recv(conn)
            assert error.error.param == "item.content[0].type"

            await conn.response.cancel()
            assert (await recv(conn)).error.code == "response_cancel_not_active"

            await conn.response.create(response={"output_modalities": ["audio"]})
            assert (await recv(conn)).error.param.startswith("response.output_modalities")

            await add_text(conn, " word" * (MAX_MODEL_LEN + 10))  # more than the context holds
            await until(conn, "conversation.item.done")
            await conn.response.create()
            error = await recv(conn)
            assert error.error.code == "context_length_exceeded" and str(MAX_MODEL_LEN) in error.error.message

            await add_text(conn, "Tell me a long story")
            await until(conn, "conversation.item.done")
            await conn.response.create(response={"max_output_tokens": 40})
            await conn.response.create(event_id="e3")
            events = await until(conn, "response.done")
            errors = [event for event in events if event.type == "error"]
            assert len(errors) == 1 and errors[0].error.code == "conversation_already_has_active_response"
            assert errors[0].error.event_id == "e3"
            first = events[-1].response
            assert first.status in ("completed", "incomplete") and first.usage.output_tokens >= 1

            # the session goes on: the next turn runs on everything so far
            events = await turn(conn, " and more", max_output_tokens=3)
            assert not [event for event in events if event.type == "error"]
            second = events[-1].response.usage
            assert second.input_tokens > first.usage.input_tokens + first.usage.output_tokens
            # the other connection saw none of it
            events = await turn(other, "Hello", max_output_tokens=3)
            assert [event for event in events if event.type == "error"] == []

    run(session())
    wait_kv_free(servers)


def test_first_response_needs_input_and_instructions_are_fixed_after_it(servers):
    async def session() -> None:
        async with client(servers).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.response.create()
            assert (await recv(conn)).error.param == "item"
            await turn(conn, "Hi", max_output_tokens=2)
            await conn.session.update(session={"type": "realtime", "instructions": "Too late"})
            assert (await recv(conn)).error.param == "session.instructions"
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [_text("x")]}, previous_item_id="item_unknown"
            )
            assert (await recv(conn)).error.param == "previous_item_id"
            events = await turn(conn, None, max_output_tokens=2)  # no new input: the model goes on
            assert events[-1].response.usage.output_tokens >= 1

    run(session())
    wait_kv_free(servers)


def test_cancel_lets_the_turn_finish_unseen_and_keeps_the_session(servers):
    async def session() -> None:
        async with client(servers).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.session.update(session={"type": "realtime", "temperature": 0.0})
            await recv(conn)
            await add_text(conn, "Once upon a time")
            await conn.response.create(response={"max_output_tokens": 120})
            created = [event for event in await until(conn, "response.created")][-1]
            await conn.response.cancel(response_id=created.response.id)
            events = await until(conn, "response.done")
            done = events[-1].response
            assert done.status == "cancelled" and done.status_details.reason == "client_cancelled"
            streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
            full = done.output[0].content[0].text
            assert full.startswith(streamed) and done.usage.output_tokens >= 1
            assert not [event for event in events if event.type == "error"]
            # the cancelled turn's tokens stay in the context: the next turn runs on them
            events = await turn(conn, " The end.", max_output_tokens=2)
            usage = events[-1].response.usage
            assert usage.input_tokens >= done.usage.input_tokens + done.usage.output_tokens + 1

    run(session())
    wait_kv_free(servers)


def test_disconnect_mid_turn_frees_the_session_kv(servers):
    wait_kv_free(servers)

    async def session() -> None:
        conn = await client(servers).realtime.connect(model=MODEL).enter()
        await recv(conn)
        await turn(conn, "Hello there", max_output_tokens=3)
        assert kv_usage(servers) > 0.0  # parked, holding its blocks (the policy holds them for 60 s)
        await add_text(conn, " and a long answer please")
        await conn.response.create(response={"max_output_tokens": 200})
        await until(conn, "response.created")
        await conn.close()

    run(session())
    wait_kv_free(servers, timeout_s=10.0)  # well before the 60 s hold would end


def test_api_key_and_model_on_the_handshake(servers):
    async def refused() -> None:
        with pytest.raises(Exception) as info:
            async with client(servers, "keyed", api_key="wrong").realtime.connect(model=MODEL) as conn:
                await recv(conn)
        assert "401" in str(info.value)

    async def accepted() -> None:
        async with client(servers, "keyed", api_key=KEY).realtime.connect(model=MODEL) as conn:
            assert (await recv(conn)).type == "session.created"

    async def unknown_model() -> None:
        async with client(servers).realtime.connect(model="nope") as conn:
            error = await recv(conn)
            assert error.type == "error" and "nope" in error.error.message

    run(refused())
    run(accepted())
    run(unknown_model())


def test_a_turn_that_fills_the_context_ends_the_session(servers):
    tokenizer = servers.engine.tokenizer
    words = next(k for k in range(MAX_MODEL_LEN, 0, -1) if len(tokenizer.encode(" word" * k)) <= MAX_MODEL_LEN - 3)
    prompt_len = len(tokenizer.encode(" word" * words))

    async def session() -> None:
        async with client(servers).realtime.connect(model=MODEL) as conn:
            await recv(conn)
            await conn.session.update(session={"type": "realtime", "temperature": 0.0, "ignore": 1})
            assert (await recv(conn)).error.param == "session.ignore"
            events = await turn(conn, " word" * words)  # max_output_tokens "inf": all the room left
            done = events[-1].response
            assert done.usage.input_tokens == prompt_len
            # greedy on this model does not stop early here: the turn takes all the room, filling the context
            assert done.status == "incomplete" and done.status_details.reason == "max_output_tokens"
            assert prompt_len + done.usage.output_tokens == MAX_MODEL_LEN
            await add_text(conn, " more")
            error = await recv(conn)
            assert error.error.code == "session_ended" and "full" in error.error.message
            await conn.response.create()
            assert (await recv(conn)).error.code == "session_ended"

    run(session())
    wait_kv_free(servers)
