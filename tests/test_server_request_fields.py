"""vLLM's request fields on ``vllite serve``, driven by the official ``openai`` client and plain HTTP, each checked
against what vLLM's documentation specifies: ``prompt_logprobs`` (equal to a Hugging Face forward pass, and never
read from the prefix cache), ``seed`` range, every bad ``logit_bias`` key named at once,
``return_tokens_as_token_ids``, ``truncation_side``, ``bad_words``, ``echo`` on chat, roles and message keys of
vLLM's chat templates, and the chat form of ``/tokenize``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")

from vllite.plugins.openai_server.testing import RemoteServer  # noqa: E402
from vllite.testing import make_tiny_model_dir_cached  # noqa: E402

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(make_tiny_model_dir_cached("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    args = [model_dir, "--served-model-name", MODEL, "--max-model-len", "256", "--dtype", "float32"]
    with RemoteServer([*args, "--trust-request-chat-template", "--seed", "0"]) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def hf_prompt_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """``[len - 1, vocab]``: log_softmax of the logits at each prompt position, predicting the next token."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(plp: list, token_ids: list[int], reference: torch.Tensor, k: int) -> None:
    """vLLM's shape: one entry per prompt token, ``None`` first, then ``{token_id: {logprob, rank,
    decoded_token}}`` holding the prompt's own token and the ``k`` most likely ones, all equal to HF's."""
    assert len(plp) == len(token_ids) and plp[0] is None
    for position, (entry, token) in enumerate(zip(plp[1:], token_ids[1:])):
        row = reference[position]
        assert str(token) in entry
        top = torch.topk(row, k)
        assert {str(t) for t in top.indices.tolist()} <= set(entry)
        for key, value in entry.items():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            assert value["logprob"] == pytest.approx(row[int(key)].item(), abs=1e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1


# ------------------------------------------------------------------------------------------------ prompt logprobs
def test_completion_prompt_logprobs_equal_hugging_face(client, hf_model):
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 3, "return_token_ids": True},
    )
    choice = response.choices[0]
    token_ids = choice.model_extra["prompt_token_ids"]
    check_prompt_logprobs(choice.model_extra["prompt_logprobs"], token_ids, hf_prompt_logprobs(hf_model, token_ids), 3)


def test_prompt_logprobs_are_never_read_from_the_prefix_cache(client, hf_model):
    prompt = list(range(40, 120))  # five full blocks of 16: cached by the first request
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache does hold this prompt
    with_plp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    assert with_plp.usage.prompt_tokens_details.cached_tokens == 0  # skip_reading_prefix_cache
    plp = with_plp.choices[0].model_extra["prompt_logprobs"]
    check_prompt_logprobs(plp, prompt, hf_prompt_logprobs(hf_model, prompt), 1)


def test_chat_prompt_logprobs_are_on_the_response(client, hf_model):
    messages = [{"role": "user", "content": PROMPT}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 0, "return_token_ids": True}
    )
    token_ids = response.model_extra["prompt_token_ids"]
    plp = response.model_extra["prompt_logprobs"]
    assert "prompt_logprobs" not in (response.choices[0].model_extra or {})
    check_prompt_logprobs(plp, token_ids, hf_prompt_logprobs(hf_model, token_ids), 0)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert plain.model_extra["prompt_logprobs"] is None  # written as null, as vLLM writes it


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_with_stream_is_400(server, path):
    body = {"model": MODEL, "max_tokens": 1, "stream": True, "prompt_logprobs": 1}
    body |= {"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]}
    status, answer = post(server, path, body)
    assert status == 400 and answer["error"]["param"] == "prompt_logprobs", answer


# ------------------------------------------------------------------------------------------------ seed, logit_bias
@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_seed_outside_int64_is_400_naming_seed(server, path, seed):
    body = {"model": MODEL, "max_tokens": 1, "seed": seed}
    body |= {"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]}
    status, answer = post(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == "seed" and "seed" in answer["error"]["message"], answer


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_seed_at_the_int64_edges_is_served(client, seed):
    response = client.completions.create(model=MODEL, prompt="x", max_tokens=2, seed=seed, temperature=1.0)
    assert response.usage.completion_tokens == 2


def test_every_bad_logit_bias_key_is_named_at_once(server):
    bias = {"abc": 1, "-3": 2, "99999999": 3, "5": 1, "7": 500}
    status, answer = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": bias})
    error = answer["error"]
    assert status == 400 and error["param"] == "logit_bias", answer
    for named in ("'abc'", "'-3'", "'99999999'", "500"):
        assert named in error["message"], error
    assert "'5'" not in error["message"]


# ------------------------------------------------------------------------------------------------ token ids
def test_return_tokens_as_token_ids_on_completions(client):
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=2,
        echo=True,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    ids = choice.model_extra["prompt_token_ids"] + choice.model_extra["token_ids"]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    for top in choice.logprobs.top_logprobs[1:]:
        assert top and all(key.startswith("token_id:") for key in top)


@pytest.mark.parametrize("as_ids", [True, False], ids=["token-ids", "text"])
def test_echoed_top_logprobs_start_with_the_positions_own_token(client, as_ids):
    """vLLM's order (its ``test_return_tokens_as_ids``): each position's ``top_logprobs`` lists that position's own
    token first (the prompt token, or the sampled one), then the top ``logprobs``."""
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        logprobs=1,
        echo=True,
        extra_body={"return_tokens_as_token_ids": as_ids},
    )
    logprobs = response.choices[0].logprobs
    assert logprobs.top_logprobs[0] is None  # the first prompt token has no logprob
    first_keys = [next(iter(top)) for top in logprobs.top_logprobs[1:]]
    assert first_keys == logprobs.tokens[1:]
    for top, token, logprob in zip(logprobs.top_logprobs[1:], logprobs.tokens[1:], logprobs.token_logprobs[1:]):
        assert top[token] == logprob and 1 <= len(top) <= 2


def test_return_tokens_as_token_ids_on_chat(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    assert all(top.token.startswith("token_id:") for c in content for top in c.top_logprobs)
    assert content[0].bytes == list(content[0].token.encode())


# ------------------------------------------------------------------------------------------------ truncation_side
@pytest.mark.parametrize(("side", "kept"), [("left", slice(-5, None)), ("right", slice(0, 5)), (None, slice(-5, None))])
def test_truncation_side_on_completions(client, side, kept):
    prompt = list(range(30, 50))
    extra = {"truncate_prompt_tokens": 5, "return_token_ids": True}
    if side is not None:
        extra["truncation_side"] = side
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
    assert response.choices[0].model_extra["prompt_token_ids"] == prompt[kept]
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body=extra)
    assert len(text.choices[0].model_extra["prompt_token_ids"]) == 5
    assert text.usage.prompt_tokens == 5


def test_truncation_side_right_on_chat(client):
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"return_token_ids": True}
    )
    cut = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=1,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": "right"},
    )
    assert cut.model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"][:4]
    assert cut.usage.prompt_tokens == 4


def test_bad_truncation_side_is_400(server):
    body = {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 2, "truncation_side": "middle"}
    status, answer = post(server, "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == "truncation_side", answer


# ------------------------------------------------------------------------------------------------ bad_words
def test_bad_words_change_the_output_and_never_appear(client):
    from vllite.builtin_logitsprocs.bad_words import bad_words_token_ids
    from vllite.engine.tokenizer import get_tokenizer

    greedy = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    first = greedy.choices[0].model_extra["token_ids"][0]
    tokenizer = get_tokenizer(make_tiny_model_dir_cached("llama"))
    word = tokenizer.decode([first]).strip()
    banned = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "bad_words": [word]},
    )
    tokens = banned.choices[0].model_extra["token_ids"]
    assert tokens != greedy.choices[0].model_extra["token_ids"]
    for sequence in bad_words_token_ids([word], tokenizer):
        n = len(sequence)
        assert all(tokens[i : i + n] != sequence for i in range(len(tokens) - n + 1)), (word, sequence, tokens)


def test_bad_words_of_the_wrong_type_is_400(server):
    status, answer = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "bad_words": "word"})
    assert status == 400 and answer["error"]["param"] == "bad_words", answer


# ------------------------------------------------------------------------------------------------ chat: echo, roles
PREFILL = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Once upon"}]


def test_chat_echo_starts_the_reply_with_the_last_message(client):
    kwargs = {"model": MODEL, "messages": PREFILL, "max_tokens": 6, "temperature": 0}
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(**kwargs, extra_body=extra)
    echoed = client.chat.completions.create(**kwargs, extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == "Once upon" + plain.choices[0].message.content
    stream = client.chat.completions.create(**kwargs, stream=True, extra_body={**extra, "echo": True})
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == echoed.choices[0].message.content


def test_chat_echo_skips_a_last_message_of_another_role(client):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 4, "temperature": 0}
    plain = client.chat.completions.create(**kwargs)
    echoed = client.chat.completions.create(**kwargs, extra_body={"echo": True})
    assert echoed.choices[0].message.content == plain.choices[0].message.content


TEMPLATE = "{% for m in messages %}[{{ m.role }}|{{ m.mood }}]{{ m.content }}{% endfor %}"


def test_other_roles_and_message_keys_reach_the_chat_template(server, client):
    messages = [{"role": "narrator", "content": "It was dark.", "mood": "calm"}]
    status, answer = post(server, "/tokenize", {"model": MODEL, "messages": messages, "chat_template": TEMPLATE})
    assert status == 200, answer
    from vllite.engine.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(make_tiny_model_dir_cached("llama"))
    assert tokenizer.decode(answer["tokens"]) == "[narrator|calm]It was dark."
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"chat_template": TEMPLATE, "return_token_ids": True}
    )
    assert response.model_extra["prompt_token_ids"] == answer["tokens"]


# ------------------------------------------------------------------------------------------------ /tokenize
def test_tokenize_continue_final_message_renders_like_chat(server, client):
    body = {"model": MODEL, "messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True}
    status, answer = post(server, "/tokenize", body)
    assert status == 200, answer
    response = client.chat.completions.create(
        model=MODEL,
        messages=PREFILL,
        max_tokens=1,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True},
    )
    assert answer["tokens"] == response.model_extra["prompt_token_ids"]
    status, closed = post(server, "/tokenize", {**body, "continue_final_message": False})
    assert closed["tokens"][: len(answer["tokens"])] == answer["tokens"] and len(closed["tokens"]) > len(
        answer["tokens"]
    )
    status, both = post(server, "/tokenize", {**body, "add_generation_prompt": True})
    assert status == 400 and both["error"]["param"] == "continue_final_message", both


def test_tokenize_passes_tools_to_the_template(server):
    template = "{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}"
    template += "{% for m in messages %}{{ m.content }}{% endfor %}"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template": template}
    _, without = post(server, "/tokenize", body)
    status, answer = post(server, "/tokenize", {**body, "tools": [tool]})
    assert status == 200, answer
    from vllite.engine.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(make_tiny_model_dir_cached("llama"))
    assert tokenizer.decode(answer["tokens"]) == "<get_weather>hi"
    assert tokenizer.decode(without["tokens"]) == "hi"


def test_prompt_embeds_without_enable_prompt_embeds_is_400(client):
    # This server runs without --enable-prompt-embeds (tests/test_server_prompt_embeds.py covers the served field).
    import base64
    import io

    buffer = io.BytesIO()
    torch.save(torch.zeros(3, 64), buffer)
    body = {"prompt_embeds": base64.b64encode(buffer.getvalue()).decode()}
    with pytest.raises(openai.BadRequestError, match="You must set `--enable-prompt-embeds`") as info:
        client.completions.create(model=MODEL, prompt="", max_tokens=2, extra_body=body)
    assert info.value.body["param"] == "prompt_embeds"
