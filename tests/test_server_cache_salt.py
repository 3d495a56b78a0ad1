"""``cache_salt`` over HTTP isolates the prefix cache, as it does offline: two requests with the same prompt share
cached blocks only when they carry the same salt (or both none), on every route that takes the field
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``), as ``usage`` reports in ``cached_tokens``."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from vllite.assets import default_model_path
from vllite.plugins.openai_server.testing import RemoteServer

MODEL = "demo"
# Several KV blocks (16 tokens each) long, so that a prefix-cache hit is visible in cached_tokens.
TEXT = "the tenant's confidential prompt, long enough to fill a few blocks of the key-value cache " * 3


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    args = [str(default_model_path()), "--served-model-name", MODEL, "--max-model-len", "512", "--disable-log-stats"]
    with RemoteServer(args) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


def cached_tokens(client: openai.OpenAI, route: str, text: str, salt: str | None) -> int:
    """The prompt tokens the request found in the prefix cache, as ``usage`` reports them."""
    extra = {} if salt is None else {"cache_salt": salt}
    if route == "completions":
        completion = client.completions.create(model=MODEL, prompt=text, max_tokens=2, extra_body=extra)
        assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
        return completion.usage.prompt_tokens_details.cached_tokens or 0
    if route == "chat":
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2, extra_body=extra
        )
        assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
        return chat.usage.prompt_tokens_details.cached_tokens or 0
    response = client.responses.create(model=MODEL, input=text, max_output_tokens=2, extra_body=extra)
    assert response.usage is not None
    return response.usage.input_tokens_details.cached_tokens


@pytest.mark.parametrize("route", ["completions", "chat", "responses"])
def test_same_prompt_shares_prefix_cache_only_with_the_same_salt(client, route):
    text = f"{route}: {TEXT}"  # a prompt no other test has cached
    assert cached_tokens(client, route, text, "tenant-a") == 0
    assert cached_tokens(client, route, text, "tenant-a") >= 16  # the same salt: the first request's blocks
    assert cached_tokens(client, route, text, "tenant-b") == 0  # another tenant: nothing of tenant-a's
    assert cached_tokens(client, route, text, None) == 0  # no salt: nothing of a salted request's
    assert cached_tokens(client, route, text, None) >= 16  # unsalted requests share with each other
    assert cached_tokens(client, route, text, "tenant-b") >= 16


def test_beam_search_keeps_the_salt(client):
    text = f"beam: {TEXT}"
    assert cached_tokens(client, "completions", text, None) == 0
    salted = client.completions.create(
        model=MODEL, prompt=text, max_tokens=2, n=2, extra_body={"use_beam_search": True, "cache_salt": "tenant-a"}
    )
    assert salted.choices  # the beams ran under tenant-a's salt: the unsalted prompt is still the only one cached
    assert cached_tokens(client, "completions", text, "tenant-a") >= 16
    assert cached_tokens(client, "completions", text, "tenant-c") == 0


@pytest.mark.parametrize("route", ["completions", "chat", "responses"])
def test_empty_cache_salt_is_a_400_naming_it(client, route):
    with pytest.raises(openai.BadRequestError) as caught:
        cached_tokens(client, route, f"empty salt {route}", "")
    assert caught.value.param == "cache_salt", caught.value
