"""LoRA adapters behind ``vllite serve``: ``--lora-modules``, ``/v1/models``, ``"model": "<adapter>"`` on every
generating route (the official ``openai`` client and plain HTTP), runtime loading and unloading, the filesystem
resolver, the ``lora_requests_info`` metric, and every bad input answered with a clear error while the server goes on.

One server serves the whole module (``VLLITE_ALLOW_RUNTIME_LORA_UPDATING=1``); the expected tokens come from
``LLM.generate(..., lora_request=...)`` with the same adapters, greedy.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.test_cli_flags import NEVER_IMPORTED, _error_line, _vllite  # noqa: E402
from tests.test_lora import _make_adapter  # noqa: E402
from tests.test_server_errors import call  # noqa: E402
from vllite.assets import default_model_path  # noqa: E402
from vllite.lora import LoRARequest  # noqa: E402
from vllite.plugins.openai_server.lora import FilesystemResolver, parse_lora_modules  # noqa: E402
from vllite.plugins.openai_server.testing import RemoteServer  # noqa: E402

MODEL = "demo"
PROMPTS = ["def fibonacci(n):", "import os", "class Stack:"]
USER = [{"role": "user", "content": "Write a function."}]
MAX_TOKENS = 8
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 256, "max_lora_rank": 16, "max_loras": 2}
# name -> (seed, rank, alpha, target modules)
ADAPTERS = {
    "sql": (1, 8, 16, ["q_proj", "v_proj"]),
    "styled": (2, 16, 32, ["o_proj", "up_proj", "down_proj"]),
    "runtime": (3, 8, 16, ["k_proj", "gate_proj"]),
    "resolved": (4, 8, 16, ["q_proj", "o_proj"]),
    "too-big": (5, 32, 32, ["q_proj"]),  # rank 32 > --max-lora-rank 16
}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-adapters")
    base = str(default_model_path())
    return {
        name: str(_make_adapter(base, root / name, seed=seed, rank=rank, alpha=alpha, targets=targets))
        for name, (seed, rank, alpha, targets) in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def resolver_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-resolver-cache")


@pytest.fixture(scope="module")
def server(adapter_dirs, resolver_dir):
    styled = {"name": "styled", "path": adapter_dirs["styled"], "base_model_name": MODEL}
    args = ["--served-model-name", MODEL, "--enable-lora", "--max-cpu-loras", "4", "--seed", "0"]
    args += [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE_ARGS.items()]
    args += ["--lora-modules", f"sql={adapter_dirs['sql']}", json.dumps(styled)]
    env = {"VLLITE_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLITE_LORA_RESOLVER_CACHE_DIR": str(resolver_dir)}
    with RemoteServer(args, env=env) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def llm():
    from vllite import LLM

    previous = os.environ.get("VLLITE_ENABLE_MULTIPROCESSING")
    os.environ["VLLITE_ENABLE_MULTIPROCESSING"] = "0"
    try:
        with LLM(str(default_model_path()), enable_lora=True, **ENGINE_ARGS) as engine:
            yield engine
    finally:
        if previous is None:
            os.environ.pop("VLLITE_ENABLE_MULTIPROCESSING", None)
        else:
            os.environ["VLLITE_ENABLE_MULTIPROCESSING"] = previous


def greedy(llm, prompts, lora: LoRARequest | None) -> list[list[int]]:
    from vllite import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def completion_ids(client, model: str, prompts=PROMPTS) -> list[list[int]]:
    response = client.completions.create(
        model=model,
        prompt=prompts,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert response.model == model
    return [choice.model_extra["token_ids"] for choice in sorted(response.choices, key=lambda c: c.index)]


def chat(client, model: str, **fields):
    return client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        **fields,
    )


def lora_info(server) -> list[dict[str, str]]:
    """The label sets of ``vllite:lora_requests_info`` in ``/metrics``."""
    status, body = call(server, "GET", "/metrics", headers={})
    assert status == 200, body
    return [
        sample.labels
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name == "vllite:lora_requests_info"
    ]


# ---------------------------------------------------------------------------------------------- listing, generating
def test_models_lists_the_adapters_with_their_parent(client, adapter_dirs):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards)[:3] == [MODEL, "sql", "styled"]
    assert cards[MODEL].model_extra["parent"] is None
    for name in ("sql", "styled"):
        assert cards[name].model_extra["parent"] == MODEL
        assert cards[name].model_extra["root"] == adapter_dirs[name]


def test_completions_with_an_adapter_equal_llm_generate(client, llm, adapter_dirs):
    sql, styled = (LoRARequest(name, i + 1, adapter_dirs[name]) for i, name in enumerate(("sql", "styled")))
    base = completion_ids(client, MODEL)
    assert base == greedy(llm, PROMPTS, None)
    for lora in (sql, styled):
        served = completion_ids(client, lora.lora_name)
        assert served == greedy(llm, PROMPTS, lora), lora.lora_name
        assert served != base, f"{lora.lora_name} changes nothing: the comparison would prove nothing"


def test_streamed_completion_with_an_adapter_equals_the_whole(client):
    whole = completion_ids(client, "sql", PROMPTS[0])[0]
    stream = client.completions.create(
        model="sql",
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    chunks = list(stream)
    assert {chunk.model for chunk in chunks} == {"sql"}
    assert [t for chunk in chunks for c in chunk.choices for t in c.model_extra.get("token_ids") or ()] == whole


def test_chat_with_an_adapter_equals_llm_generate(client, llm, adapter_dirs):
    sql = LoRARequest("sql", 1, adapter_dirs["sql"])
    response = chat(client, "sql")
    assert response.model == "sql"
    prompt_ids = response.model_extra["prompt_token_ids"]
    token_ids = response.choices[0].model_extra["token_ids"]
    assert token_ids == greedy(llm, [{"prompt_token_ids": prompt_ids}], sql)[0]
    base = chat(client, MODEL).choices[0].model_extra["token_ids"]
    assert token_ids != base
    streamed = chat(client, "sql", stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == response.choices[0].message.content


def test_an_unknown_model_is_404_on_every_route(client, server):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nosuch", prompt="hi", max_tokens=2)
    message = info.value.body["message"]
    assert "nosuch" in message and "sql" in message and "styled" in message  # it lists what is served
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nosuch", messages=USER, max_tokens=2)
    status, body = call(server, "POST", "/v1/completions", {"model": "nosuch", "prompt": "hi"}, headers={})
    assert status == 404 and json.loads(body)["error"]["param"] == "model"
    status, _ = call(server, "POST", "/tokenize", {"model": "sql", "prompt": "hi"}, headers={})
    assert status == 200  # an adapter's name is a served model everywhere


def test_llm_with_an_adapter_that_cannot_load_fails_that_request_alone(llm, tmp_path):
    from vllite import SamplingParams

    bad = LoRARequest("not-there", 77, str(tmp_path / "not-there"))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:2], params, lora_request=[bad, None], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error" and "not-there" in outputs[0].outputs[0].error
    assert len(outputs[1].outputs[0].token_ids) == 2


# ---------------------------------------------------------------------------------------------- runtime updates
def test_load_use_and_unload_an_adapter_at_run_time(client, server, llm, adapter_dirs):
    body = {"lora_name": "runtime", "lora_path": adapter_dirs["runtime"]}
    status, text = call(server, "POST", "/v1/load_lora_adapter", body, headers={})
    assert (status, text.decode()) == (200, "Success: LoRA adapter 'runtime' added successfully.")
    assert "runtime" in [m.id for m in client.models.list().data]
    expected = greedy(llm, PROMPTS[:1], LoRARequest("runtime", 9, adapter_dirs["runtime"]))
    assert completion_ids(client, "runtime", PROMPTS[:1]) == expected

    status, text = call(server, "POST", "/v1/load_lora_adapter", body, headers={})
    assert status == 400
    assert json.loads(text)["error"]["message"] == "The lora adapter 'runtime' has already been loaded."

    status, text = call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "runtime"}, headers={})
    assert (status, text.decode()) == (200, "Success: LoRA adapter 'runtime' removed successfully.")
    assert "runtime" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="runtime", prompt="hi", max_tokens=2)
    status, text = call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "runtime"}, headers={})
    assert status == 404
    assert json.loads(text)["error"]["message"] == "The lora adapter 'runtime' cannot be found."


def test_a_name_loaded_again_never_reuses_the_old_adapters_cached_blocks(client, server, llm, adapter_dirs):
    """The prefix cache keys blocks by adapter name: loading a name again (other weights) resets it."""
    prompt = " ".join(["def add(a, b): return a + b"] * 6)  # several full KV blocks

    def run() -> tuple[list[int], int]:
        response = client.completions.create(
            model="reloaded",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return response.choices[0].model_extra["token_ids"], response.usage.prompt_tokens_details.cached_tokens

    def load(path: str) -> None:
        body = {"lora_name": "reloaded", "lora_path": path}
        assert call(server, "POST", "/v1/load_lora_adapter", body, headers={})[0] == 200

    load(adapter_dirs["runtime"])
    first, _ = run()
    again, cached = run()
    assert again == first and cached > 0  # the cache serves the same adapter
    assert call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "reloaded"}, headers={})[0] == 200
    load(adapter_dirs["sql"])
    tokens, cached = run()
    assert cached == 0
    assert tokens == greedy(llm, [prompt], LoRARequest("reloaded", 11, adapter_dirs["sql"]))[0] != first
    assert call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "reloaded"}, headers={})[0] == 200


@pytest.mark.parametrize(
    ("name", "path", "message"),
    [
        ("missing", "/no/such/adapter", "/no/such/adapter"),
        ("too-big", None, "rank"),
        (MODEL, None, "served base model"),
    ],
)
def test_an_adapter_that_does_not_fit_is_400(server, client, adapter_dirs, name, path, message):
    body = {"lora_name": name, "lora_path": path or adapter_dirs["too-big"]}
    status, text = call(server, "POST", "/v1/load_lora_adapter", body, headers={})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["type"] == "BadRequestError" and message in error["message"], error
    assert name not in [m.id for m in client.models.list().data[1:]]  # nothing was added
    assert completion_ids(client, "sql", PROMPTS[:1])  # and the server goes on


def test_a_load_without_a_path_is_400_naming_the_field(server):
    status, text = call(server, "POST", "/v1/load_lora_adapter", {"lora_name": "x"}, headers={})
    assert status == 400 and "lora_path" in json.loads(text)["error"]["message"]


def test_an_adapter_in_use_is_not_unloaded_and_the_metric_shows_it(client, server):
    stream = client.completions.create(
        model="styled", prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    iterator = iter(stream)
    first = next(iterator)  # the request is running: it has produced output
    assert first.model == "styled"
    during = lora_info(server)
    status, text = call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "styled"}, headers={})
    rest = list(iterator)
    assert status == 400 and "in use by 1 unfinished request" in json.loads(text)["error"]["message"]
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"  # it ran to its end
    assert during == [{"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": "styled"}]
    assert lora_info(server) == [{"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}]
    assert "styled" in [m.id for m in client.models.list().data]


def test_the_metric_names_every_adapter_in_flight(client, server):
    results: list[int] = []

    def run(model: str) -> None:
        results.append(len(completion_ids(client, model, PROMPTS[:1])))

    threads = [threading.Thread(target=run, args=(model,)) for model in ("sql", "styled", MODEL)]
    for thread in threads:
        thread.start()
    seen: set[str] = set()
    while any(thread.is_alive() for thread in threads):
        for labels in lora_info(server):
            for key in ("waiting_lora_adapters", "running_lora_adapters"):
                seen.update(filter(None, labels[key].split(",")))
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    assert results == [1, 1, 1]
    assert seen <= {"sql", "styled"}  # never the base model


# ---------------------------------------------------------------------------------------------- the resolver
def test_the_filesystem_resolver_serves_a_folder_on_first_use(client, server, llm, adapter_dirs, resolver_dir):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="resolved", prompt="hi", max_tokens=2)  # not there yet
    shutil.copytree(adapter_dirs["resolved"], resolver_dir / "resolved")
    expected = greedy(llm, PROMPTS[:1], LoRARequest("resolved", 5, adapter_dirs["resolved"]))
    assert completion_ids(client, "resolved", PROMPTS[:1]) == expected
    card = {m.id: m for m in client.models.list().data}["resolved"]
    assert card.model_extra["parent"] == MODEL and card.model_extra["root"] == str(resolver_dir / "resolved")
    assert chat(client, "resolved").model == "resolved"  # served now, on every route


def test_a_resolved_adapter_that_does_not_fit_is_400(client, adapter_dirs, resolver_dir):
    shutil.copytree(adapter_dirs["too-big"], resolver_dir / "resolved-big")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="resolved-big", prompt="hi", max_tokens=2)
    assert "was found but could not be loaded" in info.value.body["message"]
    assert "rank" in info.value.body["message"]


# ---------------------------------------------------------------------------------------------- start-up, in-process
def test_the_runtime_routes_exist_only_with_the_switch():
    """Without VLLITE_ALLOW_RUNTIME_LORA_UPDATING the routes are not there: 404 (the app is driven in-process)."""
    from vllite.plugins.openai_server.app import build_app
    from vllite.plugins.openai_server.context import ServerSettings

    async def unload(name: str) -> None:
        return None

    async def post(runtime_updating: bool, path: str, body: dict) -> tuple[int, bytes]:
        loras = SimpleNamespace(runtime_updating=runtime_updating, unload=unload)
        settings = ServerSettings(served_model_names=("m",), dev_mode=False)
        ctx = SimpleNamespace(loras=loras, settings=settings, engine=SimpleNamespace(errored=False))
        app = build_app(ctx)  # type: ignore[arg-type]
        incoming = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
        sent: list[dict] = []

        async def receive() -> dict:
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        await app(scope, receive, send)
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    body = {"lora_name": "x"}
    assert asyncio.run(post(True, "/v1/unload_lora_adapter", body)) == (
        200,
        b"Success: LoRA adapter 'x' removed successfully.",
    )
    for path in ("/v1/unload_lora_adapter", "/v1/load_lora_adapter"):
        assert asyncio.run(post(False, path, {**body, "lora_path": "/p"}))[0] == 404


def test_lora_modules_without_enable_lora_is_a_start_up_error():
    result = _vllite("serve", "--lora-modules", "a=/x", "--executor", NEVER_IMPORTED, "--port", "0")
    assert result.returncode == 2
    line = _error_line(result)
    assert line == "vllite: error: --lora-modules needs --enable-lora (LoRA adapters are off without it)."


def test_generate_refuses_lora_modules_naming_serve():
    result = _vllite("generate", "--lora-modules", "a=/x", "hi")
    line = _error_line(result)
    assert line.startswith("vllite: error: --lora-modules is not supported by vllite yet; ") and "vllite serve" in line


def test_lora_modules_forms_and_mistakes():
    parsed = parse_lora_modules(
        ["a=/p/a", '{"name": "b", "path": "/p/b", "base_model_name": "m"}', '{"name": "c", "path": "/p/c"}'],
        enable_lora=True,
    )
    assert [(m.name, m.path, m.base_model_name) for m in parsed] == [
        ("a", "/p/a", None),
        ("b", "/p/b", "m"),
        ("c", "/p/c", None),
    ]
    mistakes = {
        "a": "expected NAME=PATH or JSON",
        "=/p": "expected NAME=PATH",
        "{bad json": "expected NAME=PATH or JSON",
        '{"name": "a"}': "'name' and 'path' must be non-empty strings",
        '{"name": "a", "path": "/p", "rank": 8}': "unknown field(s) rank",
    }
    for item, message in mistakes.items():
        with pytest.raises(ValueError) as info:
            parse_lora_modules([item], enable_lora=True)
        assert message in str(info.value), item
    with pytest.raises(ValueError, match="more than once"):
        parse_lora_modules(["a=/p", "a=/q"], enable_lora=True)
    with pytest.raises(ValueError, match="also a served model name"):
        parse_lora_modules(["m=/p"], enable_lora=True, served_model_names=("m",))


def test_filesystem_resolver(tmp_path, monkeypatch):
    adapter = tmp_path / "good"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (tmp_path / "prefix").mkdir()
    (tmp_path / "prefix" / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    (tmp_path / "empty").mkdir()
    resolver = FilesystemResolver(str(tmp_path))
    found = resolver.resolve_lora("base", "good")
    assert found is not None and (found.lora_name, found.lora_path) == ("good", str(adapter))
    for name in ("prefix", "empty", "nosuch", "../good", str(adapter), ""):
        assert resolver.resolve_lora("base", name) is None, name
    monkeypatch.delenv("VLLITE_LORA_RESOLVER_CACHE_DIR", raising=False)
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(tmp_path))  # vLLM's name works too
    assert FilesystemResolver().resolve_lora("base", "good") is not None
    monkeypatch.delenv("VLLM_LORA_RESOLVER_CACHE_DIR")
    assert FilesystemResolver().resolve_lora("base", "good") is None  # unset: resolves nothing
    with pytest.raises(ValueError, match="is not a folder"):
        FilesystemResolver(str(tmp_path / "nosuch"))
