"""Repetition detection (issue 43): vLLM's ``SamplingParams.repetition_detection`` (``max_pattern_size``,
``min_pattern_size``, ``min_count``) ends a looping request with ``finish_reason="repetition"`` and
``stop_reason="repetition_detected"``; with ``extra_args={"repetition_detection_scope": "reasoning"}`` only the
reasoning section is ended (the builtin ``repetition_detection`` logits processor forces its end marker). Driven
through ``LLM`` on the shipped demo model (which loops under greedy decoding) and through ``vllite serve`` with the
official ``openai`` client; every bad setting is refused naming its field."""

from __future__ import annotations

import msgspec
import pytest

from vllite import LLM, SamplingParams
from vllite.repetition import RepetitionDetectionParams, check_sequence_repetition
from vllite.testing.logitsprocs import FORCED_TOKENS_KEY

openai = pytest.importorskip("openai")

from vllite.plugins.openai_server.testing import FORCED_SEQUENCE, RemoteServer  # noqa: E402

LOOPING_PROMPT = "the the the the the the"  # the demo model answers "following the following the ..." greedily
START, END = [11], [12, 13]  # reasoning markers passed per request (the demo model's config names none)


def detection(max_pattern_size: int, min_count: int, min_pattern_size: int = 0) -> dict:
    return {"max_pattern_size": max_pattern_size, "min_pattern_size": min_pattern_size, "min_count": min_count}


@pytest.fixture(scope="module")
def llm():
    return LLM(logits_processors=[FORCED_SEQUENCE], max_model_len=256, num_gpu_blocks_override=128)


def run(llm: LLM, prompt: str = "hello", **sampling) -> object:
    params = SamplingParams(temperature=0.0, **{"max_tokens": 30, **sampling})
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


# ---------------------------------------------------------------- the check itself
@pytest.mark.parametrize(
    ("tokens", "params", "expected"),
    [
        ([1, 2, 3, 1, 2, 3, 1, 2, 3], RepetitionDetectionParams(max_pattern_size=3, min_count=3), True),
        ([1, 2, 3, 1, 2, 3, 1, 2], RepetitionDetectionParams(max_pattern_size=3, min_count=3), False),
        ([9, 9, 9], RepetitionDetectionParams(max_pattern_size=1, min_count=3), True),
        ([9, 9, 9], RepetitionDetectionParams(max_pattern_size=1, min_count=4), False),
        # min_pattern_size skips the shorter patterns: "9" x6 is not a 2-token pattern x4
        ([9] * 6, RepetitionDetectionParams(max_pattern_size=3, min_pattern_size=2, min_count=4), False),
        ([9] * 8, RepetitionDetectionParams(max_pattern_size=3, min_pattern_size=2, min_count=4), True),
        ([1, 2] * 5, RepetitionDetectionParams(max_pattern_size=0, min_count=0), False),  # disabled
        ([4, 1, 2, 1, 2], RepetitionDetectionParams(max_pattern_size=2, min_count=2), True),  # only the tail counts
    ],
)
def test_check_sequence_repetition(tokens, params, expected):
    assert check_sequence_repetition(tokens, params) is expected


# ---------------------------------------------------------------- through LLM
def test_demo_model_loop_ends_with_repetition(llm):
    free = run(llm, LOOPING_PROMPT)
    looped = run(llm, LOOPING_PROMPT, repetition_detection=detection(2, 3))
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    # The free-running answer starts with a 2-token pattern three times; detection ends the request right there.
    assert free.token_ids[0:2] == free.token_ids[2:4] == free.token_ids[4:6]
    assert looped.finish_reason == "repetition" and looped.stop_reason == "repetition_detected"
    assert looped.token_ids == free.token_ids[:6]


def test_ends_exactly_when_the_pattern_completes(llm):
    forced = {FORCED_TOKENS_KEY: [5, 6, 7] * 6}
    out = run(llm, extra_args=forced, repetition_detection=detection(3, 3))
    assert out.token_ids == [5, 6, 7] * 3 and out.finish_reason == "repetition"
    # Patterns of 4..6 tokens only: "5 6 7" x3 does not count; "5 6 7 5 6 7" x3 (18 tokens) does.
    out = run(llm, extra_args=forced, repetition_detection=detection(6, 3, min_pattern_size=4))
    assert out.token_ids == [5, 6, 7] * 6 and out.finish_reason == "repetition"
    # A SamplingParams struct works as well as a dict, and min_tokens comes first.
    params = RepetitionDetectionParams(max_pattern_size=3, min_count=3)
    out = run(llm, extra_args=forced, repetition_detection=params, min_tokens=12)
    assert out.token_ids == [5, 6, 7] * 4 and out.finish_reason == "repetition"


def test_reasoning_scope_ends_only_the_reasoning_section(llm):
    loop_in_reasoning = [*START, 5, 6, 5, 6, 5, 6]
    extra = {FORCED_TOKENS_KEY: loop_in_reasoning, "think_start_token_ids": START, "think_end_token_ids": END}
    whole = run(llm, extra_args=extra, repetition_detection=detection(2, 3))
    assert whole.token_ids == loop_in_reasoning and whole.finish_reason == "repetition"
    scoped = run(
        llm, extra_args={**extra, "repetition_detection_scope": "reasoning"}, repetition_detection=detection(2, 3)
    )
    # The loop completes at 7 tokens; the end marker is forced next, and the request goes on to max_tokens.
    assert scoped.token_ids[:9] == [*loop_in_reasoning, *END]
    assert scoped.finish_reason == "length" and len(scoped.token_ids) == 30


def test_reasoning_scope_without_markers_fails_the_request_naming_them(llm):
    extra = {FORCED_TOKENS_KEY: [5, 6] * 4, "repetition_detection_scope": "reasoning"}
    out = run(llm, extra_args=extra, repetition_detection=detection(2, 3))
    assert out.finish_reason == "error" and "think_start_token_ids" in out.error and "think_end_token_ids" in out.error
    ok = run(llm, extra_args={FORCED_TOKENS_KEY: [5, 6] * 4}, repetition_detection=detection(2, 3))
    assert ok.finish_reason == "repetition"  # the engine and other requests are unaffected


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"max_pattern_size": 2, "min_count": 1}, "repetition_detection.min_count"),
        ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "repetition_detection.min_pattern_size"),
        ({"max_pattern_size": -1}, "repetition_detection.max_pattern_size"),
        ({"max_pattern_size": "4", "min_count": 2}, "repetition_detection.max_pattern_size"),
        ({"max_pattern_size": 4, "min_count": 2, "window": 9}, "repetition_detection"),
        ("yes", "repetition_detection"),
    ],
)
def test_bad_config_is_refused_naming_the_field(value, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        SamplingParams(repetition_detection=value)


def test_bad_scope_is_refused_at_submit(llm):
    with pytest.raises(ValueError, match="repetition_detection_scope"):
        run(llm, extra_args={"repetition_detection_scope": "answer"}, repetition_detection=detection(2, 3))
    with pytest.raises(ValueError, match=r"repetition_detection_scope.*needs repetition_detection"):
        run(llm, extra_args={"repetition_detection_scope": "reasoning"})


def test_travels_on_the_wire():
    params = SamplingParams(repetition_detection=detection(4, 2, min_pattern_size=2))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.repetition_detection == RepetitionDetectionParams(
        max_pattern_size=4, min_pattern_size=2, min_count=2
    )
    assert params.clone().repetition_detection == decoded.repetition_detection


# ---------------------------------------------------------------- through vllite serve
@pytest.fixture(scope="module")
def client():
    args = ["--served-model-name", "demo", "--logits-processors", FORCED_SEQUENCE, "--max-model-len", "256"]
    args += ["--reasoning-parser", "think"]
    with RemoteServer(args) as remote, openai.OpenAI(base_url=remote.base_url, api_key="unused", max_retries=0) as c:
        yield c


def test_http_finish_reason_is_repetition(client):
    body = {"vllm_xargs": {FORCED_TOKENS_KEY: [5, 6, 7] * 5}, "repetition_detection": detection(3, 3)}
    out = client.completions.create(model="demo", prompt="hello", max_tokens=30, temperature=0, extra_body=body)
    assert out.choices[0].finish_reason == "repetition"
    assert out.usage.completion_tokens == 9
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=30, temperature=0, extra_body=body
    )
    assert chat.choices[0].finish_reason == "repetition" and chat.usage.completion_tokens == 9
    stream = client.completions.create(
        model="demo", prompt="hello", max_tokens=30, temperature=0, extra_body=body, stream=True
    )
    reasons = [choice.finish_reason for chunk in stream for choice in chunk.choices]
    assert reasons[-1] == "repetition" and set(reasons[:-1]) <= {None}


def test_http_reasoning_scope_forces_the_parsers_end_marker(client):
    from transformers import AutoTokenizer

    from vllite.assets import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    think = tokenizer.encode("<think>", add_special_tokens=False)
    xargs = {FORCED_TOKENS_KEY: [*think, 5, 6, 5, 6, 5, 6], "repetition_detection_scope": "reasoning"}
    chat = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=30,
        temperature=0,
        extra_body={"vllm_xargs": xargs, "repetition_detection": detection(2, 3)},
    )
    choice = chat.choices[0]
    # The markers come from --reasoning-parser think: the loop ends the reasoning, the model goes on answering.
    assert choice.finish_reason == "length" and chat.usage.completion_tokens == 30
    assert choice.message.model_extra["reasoning_content"] == tokenizer.decode([5, 6] * 3)
    assert choice.message.content


def test_http_bad_config_is_a_400_naming_the_field(client):
    for value, named in (
        ({"max_pattern_size": 2, "min_count": 1}, "min_count"),
        ({"max_pattern_size": 2, "min_count": 2, "window": 3}, "window"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model="demo", prompt="hello", max_tokens=5, extra_body={"repetition_detection": value}
            )
        assert named in info.value.message and info.value.body["param"] == "repetition_detection"
    with pytest.raises(openai.BadRequestError, match="repetition_detection_scope"):
        client.completions.create(
            model="demo",
            prompt="hello",
            max_tokens=5,
            extra_body={"vllm_xargs": {"repetition_detection_scope": "everything"}},
        )
