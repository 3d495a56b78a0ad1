"""The completions API's ``prompt_embeds`` (``vllite serve --enable-prompt-embeds``) with the official ``openai``
client, as vLLM's documentation sends it: ``prompt=""`` and ``extra_body={"prompt_embeds": base64 of a torch.save'd
tensor}``. Greedy completions equal the token-id prompt's; embeds prompts come first when a request mixes them with
``prompt``; bad payloads are HTTP 400s naming ``prompt_embeds`` and the server keeps serving. (Without the flag the
field is refused: tests/test_server_request_fields.py, whose server runs without it.)"""

from __future__ import annotations

import base64
import io

import pytest
import torch

openai = pytest.importorskip("openai")

from vllite.plugins.openai_server.testing import RemoteServer  # noqa: E402

MODEL = "tiny"
TEXTS = ["def add(a, b):", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def serve(tiny_llama_dir: str, *extra: str) -> RemoteServer:
    args = [tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len", "128", "--dtype", "float32", *extra]
    return RemoteServer(args)


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    flags = ("--enable-prompt-embeds", "--max-num-batched-tokens", "8", "--block-size", "4")
    with (
        serve(tiny_llama_dir, *flags) as server,
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as c,
    ):
        yield c


def b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@torch.inference_mode()
def embeds_of(tiny_llama_hf, tokenizer, text: str) -> tuple[list[int], torch.Tensor]:
    ids = tokenizer.encode(text)
    return ids, tiny_llama_hf.get_input_embeddings()(torch.tensor(ids)).clone()


def complete(client, **kwargs):
    extra = kwargs.pop("extra", {})
    return client.completions.create(model=MODEL, max_tokens=8, temperature=0.0, extra_body=extra, **kwargs)


def test_prompt_embeds_equal_token_prompt(client, tiny_llama_hf, tokenizer):
    ids, embeds = embeds_of(tiny_llama_hf, tokenizer, TEXTS[0])
    by_embeds = complete(client, prompt="", extra={"prompt_embeds": b64(embeds), "return_token_ids": True})
    by_ids = complete(client, prompt=ids, extra={"return_token_ids": True})
    assert len(by_embeds.choices) == 1
    assert by_embeds.choices[0].token_ids == by_ids.choices[0].token_ids
    assert by_embeds.choices[0].text == by_ids.choices[0].text
    assert by_embeds.usage.prompt_tokens == len(ids)


def test_embeds_come_before_prompts_in_a_mixed_request(client, tiny_llama_hf, tokenizer):
    ids0, embeds0 = embeds_of(tiny_llama_hf, tokenizer, TEXTS[0])
    ids1, embeds1 = embeds_of(tiny_llama_hf, tokenizer, TEXTS[1])
    expected = [complete(client, prompt=ids).choices[0].text for ids in (ids0, ids1)]
    mixed = complete(client, prompt=[ids0], extra={"prompt_embeds": [b64(embeds1)]})
    assert [c.index for c in mixed.choices] == [0, 1]
    assert [c.text for c in mixed.choices] == [expected[1], expected[0]]
    both = complete(client, prompt="", extra={"prompt_embeds": [b64(embeds0), b64(embeds1[None].to(torch.bfloat16))]})
    assert both.choices[0].text == expected[0] and len(both.choices) == 2
    stream = complete(client, prompt="", stream=True, extra={"prompt_embeds": b64(embeds1)})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[1]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("not base64!", "not valid base64"),
        (base64.b64encode(b"not a torch file").decode(), "could not be loaded"),
        ("tensor:wide", "does not match the model's hidden size"),
        ("tensor:int", "floating-point dtype"),
        ("tensor:empty", "is empty"),
        ("tensor:1d", "must be 2-D"),
        ("dict", "must hold a torch.Tensor"),
    ],
)
def test_bad_prompt_embeds_are_400_and_server_serves_on(client, tiny_llama_hf, tokenizer, payload, message):
    hidden = tiny_llama_hf.config.hidden_size
    tensors = {
        "tensor:wide": torch.zeros(3, hidden + 1),
        "tensor:int": torch.zeros(3, hidden, dtype=torch.int32),
        "tensor:empty": torch.zeros(0, hidden),
        "tensor:1d": torch.zeros(hidden),
    }
    if payload in tensors:
        payload = b64(tensors[payload])
    elif payload == "dict":
        payload = b64({"a": torch.zeros(2)})  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, prompt="", extra={"prompt_embeds": payload})
    assert message in info.value.message
    assert info.value.body["param"] == "prompt_embeds"
    ids, _ = embeds_of(tiny_llama_hf, tokenizer, TEXTS[0])
    assert complete(client, prompt=ids).choices[0].finish_reason == "length"


def test_echo_with_prompt_embeds_is_400(client, tiny_llama_hf, tokenizer):
    _, embeds = embeds_of(tiny_llama_hf, tokenizer, TEXTS[0])
    with pytest.raises(openai.BadRequestError, match="echo is not supported with prompt_embeds"):
        complete(client, prompt="", echo=True, extra={"prompt_embeds": b64(embeds)})
