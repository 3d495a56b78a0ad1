"""``vllite serve`` driven by the official ``openai`` client: completions, chat, streaming, n > 1, logprobs, stop
strings, seeds, usage, tool calling (a real model whose output a logits processor forces), Continuum fields."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from vllite.assets import default_model_path  # noqa: E402
from vllite.plugins.openai_server.testing import FORCED_SEQUENCE, RemoteServer  # noqa: E402

MODEL = "demo"
PROMPTS = ["Once upon a time", "def main():", "The quick brown fox"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", MODEL, "other-name", "--tool-call-parser", "hermes"]
    args += ["--logits-processors", FORCED_SEQUENCE, "--max-model-len", "512", "--seed", "0"]
    with RemoteServer(args) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    from vllite.engine.tokenizer import get_tokenizer

    return get_tokenizer(default_model_path())


def forced(tokenizer, text: str) -> dict:
    """``extra_body`` that makes the model emit ``text`` and then EOS."""
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    return {"vllm_xargs": {"forced_token_ids": ids}}


def test_models_lists_every_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL, "other-name"]


def test_greedy_completions_equal_llm_generate(client):
    from vllite import LLM, SamplingParams

    response = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    with LLM(model=str(default_model_path()), max_model_len=512) as llm:
        expected = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice, out in zip(response.choices, expected):
        assert choice.text == out.outputs[0].text
        assert choice.model_extra["token_ids"] == list(out.outputs[0].token_ids)
        assert choice.finish_reason == out.outputs[0].finish_reason == "length"
    assert response.usage.completion_tokens == 36
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)


def test_streamed_completion_equals_whole_and_reports_usage(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_token_id_prompts_and_echo(client, tokenizer):
    ids = tokenizer.encode(PROMPTS[1])  # what the server makes of the text: BOS included
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[1] + by_text.choices[0].text


def test_n_samples_seeded_and_reproducible(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, n=3, seed=1234)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    other = client.completions.create(**{**kwargs, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]
    assert first.usage.completion_tokens == 30


def test_n_samples_streamed(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, n=2, seed=3, stream=True)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, n=2, seed=3)
    assert texts == {c.index: c.text for c in whole.choices}


def test_completion_logprobs(client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and logprob <= 0.0
        assert top[token] == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_stop_strings(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    text = whole.choices[0].text
    stop = text[5:8]
    assert stop and stop not in text[:5]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop


def test_chat_whole_and_streamed(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_prompt_tokens_match_tokenize(server, client):
    import urllib.request

    messages = [{"role": "user", "content": "Count me"}]
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    request = urllib.request.Request(server.url + "/tokenize", body, {"Content-Type": "application/json"})
    count = json.load(urllib.request.urlopen(request))["count"]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert response.usage.prompt_tokens == count


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(t.token for t in content) == response.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)


TOOL_TEXT = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_tool_call_auto(client, tokenizer):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        extra_body=forced(tokenizer, TOOL_TEXT),
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")


def test_tool_call_auto_streamed(client, tokenizer):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice="auto",
        stream=True,
        extra_body=forced(tokenizer, TOOL_TEXT),
    )
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert content == "Let me check."
    assert finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_tool_choice_none_returns_the_text(client, tokenizer):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice="none",
        extra_body=forced(tokenizer, TOOL_TEXT),
    )
    assert response.choices[0].message.content == TOOL_TEXT
    assert not response.choices[0].message.tool_calls
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named_function(client, tokenizer, stream):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body=forced(tokenizer, '{"city": "Oslo"}'),
    )
    if not stream:
        (call,) = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    else:
        name = arguments = ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
    assert name == "get_weather" and json.loads(arguments) == {"city": "Oslo"}


def test_tool_choice_required_parses_the_call(client, tokenizer):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice="required",  # constrained to vLLM's JSON list of calls, whatever --tool-call-parser says
        extra_body=forced(tokenizer, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
    )
    assert response.choices[0].finish_reason == "tool_calls"
    assert response.choices[0].message.tool_calls[0].function.name == "get_weather"


REQUIRED_CUT = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_weather", "parameters": {"c'


def required_cut_kwargs(tokenizer) -> dict:
    """A ``required`` reply forced to list two calls, cut by ``max_tokens`` inside the second."""
    return dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=len(tokenizer.encode(REQUIRED_CUT, add_special_tokens=False)),
        extra_body=forced(tokenizer, REQUIRED_CUT + 'ity": "Oslo"}}]'),
    )


def test_tool_choice_required_cut_by_max_tokens(client, tokenizer):
    """A ``required`` reply cut mid-list: the calls that were complete, no garbled content, ``finish_reason="length"``
    (vLLM's)."""
    choice = client.chat.completions.create(**required_cut_kwargs(tokenizer)).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content, choice.message.content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})]


def test_tool_choice_required_cut_by_max_tokens_streamed(client, tokenizer):
    """Streamed, a chunk has at most one choice per index, so code reading ``chunk.choices[0]`` sees the complete
    call and ``finish_reason="length"``, and no garbled content."""
    calls: dict[int, list[str]] = {}
    content, finish_reasons = "", []
    for chunk in client.chat.completions.create(stream=True, **required_cut_kwargs(tokenizer)):
        indexes = [c.index for c in chunk.choices]
        assert len(indexes) == len(set(indexes)), f"two choices of one index in one chunk: {chunk.choices}"
        if not chunk.choices:
            continue
        first = chunk.choices[0]
        content += first.delta.content or ""
        finish_reasons.append(first.finish_reason)
        for delta in first.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or ""
            entry[1] += delta.function.arguments or ""
    assert [r for r in finish_reasons if r] == ["length"] and finish_reasons[-1] == "length"
    assert content == ""
    assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == [("get_weather", {"city": "Paris"})]


def test_vllm_extras_pass_through(client):
    ignore = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=8,
        temperature=0,
        extra_body={"min_tokens": 8, "ignore_eos": True, "repetition_penalty": 1.3, "top_k": 5, "min_p": 0.01},
    )
    assert ignore.usage.completion_tokens == 8
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert ignore.choices[0].text != plain.choices[0].text  # repetition_penalty changed the greedy choice


def test_continuum_fields_reach_extra_args():
    from vllite.plugins.openai_server.protocol import ChatCompletionRequest, CompletionRequest
    from vllite.plugins.openai_server.sampling import build_sampling_params

    body = {"prompt": "x", "job_id": 7, "is_last_step": False, "this_func_call": "ls", "vllm_xargs": {"k": 1}}
    params = build_sampling_params(CompletionRequest(**body), {}, max_tokens=4, logprobs=None)
    assert params.extra_args == {"k": 1, "job_id": "7", "is_last_step": False, "this_func_call": "ls"}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], vllm_xargs={"job_id": "j1"})
    assert build_sampling_params(chat, {}, max_tokens=4, logprobs=None).extra_args == {"job_id": "j1"}


def test_a_parser_that_only_names_tools_is_refused_at_start(monkeypatch):
    import vllite.plugin_manager as plugin_manager
    from vllite.plugins.openai_server.context import resolve_tool_parser

    class NameOnly:
        def parse(self, text):
            return None

    monkeypatch.setattr(plugin_manager, "resolve_component", lambda kind, name: NameOnly)
    with pytest.raises(ValueError, match="only names tools"):
        resolve_tool_parser("name-only")


def test_tokenize_detokenize_round_trip(server, tokenizer):
    import urllib.request

    def post(path, body):
        request = urllib.request.Request(
            server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        return json.load(urllib.request.urlopen(request))

    tokens = post("/tokenize", {"model": MODEL, "prompt": "def main():", "add_special_tokens": False})
    assert tokens["tokens"] == tokenizer.encode("def main():", add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    assert post("/detokenize", {"model": MODEL, "tokens": tokens["tokens"]}) == {"prompt": "def main():"}


def test_api_key_from_the_environment(monkeypatch):
    import argparse

    from vllite.plugins.openai_server.cli import add_serve_arguments, server_settings

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    monkeypatch.setenv("VLLITE_API_KEY", "from-env")
    assert server_settings(parser.parse_args([]), "m").api_key == "from-env"
    assert server_settings(parser.parse_args(["--api-key", "flag"]), "m").api_key == "flag"
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        server_settings(parser.parse_args(["--enable-auto-tool-choice"]), "m")


def test_an_unknown_model_is_404_listing_the_served_names(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert caught.value.body["message"] == "The model `gpt-9` does not exist. This server serves: demo, other-name."
    assert caught.value.body["param"] == "model"


TOOL_ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
]


def test_the_demo_chat_template_renders_the_tool_round_trip(server, client, tokenizer):
    import urllib.request

    body = json.dumps({"model": MODEL, "messages": TOOL_ROUND_TRIP}).encode()
    request = urllib.request.Request(server.url + "/tokenize", body, {"Content-Type": "application/json"})
    rendered = tokenizer.decode(json.load(urllib.request.urlopen(request))["tokens"])
    assert rendered == (
        "<|endoftext|><|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>tool\n22 C, sunny<|im_end|>\n<|im_start|>assistant\n"
    )
    response = client.chat.completions.create(model=MODEL, messages=TOOL_ROUND_TRIP, tools=TOOLS, max_tokens=4)
    assert response.choices[0].finish_reason in ("length", "stop", "tool_calls")


FILM = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 20}},
    "required": ["title"],
    "additionalProperties": False,  # whitespace is then the only thing that can run long
}


def test_response_format_on_the_demo_model_does_not_pad_with_whitespace(client):
    # The server defaults disable_any_whitespace for the demo model (no --structured-outputs-config here): with
    # free whitespace between JSON tokens, the demo model pads until max_tokens.
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON?"}],
        n=6,
        seed=1,
        temperature=1.0,
        max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "film", "schema": FILM}},
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content)["title"], str)


def _abort_count(server) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllite:request_success_total" and sample.labels["finished_reason"] == "abort":
                return sample.value
    raise AssertionError("no vllite:request_success_total{finished_reason='abort'} series")


def test_an_aborted_request_counts_in_request_success_abort(server, client):
    import time

    before = _abort_count(server)
    stream = client.completions.create(
        model=MODEL, prompt="def main():", max_tokens=480, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()  # the client goes away: the server aborts the request in the engine
    deadline = time.monotonic() + 20
    while _abort_count(server) < before + 1:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.2)
    assert _abort_count(server) == before + 1
