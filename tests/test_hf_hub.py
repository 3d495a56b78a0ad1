"""Hugging Face Hub model ids (``vllite.plugins.hf_hub``): ``LLM("org/name")`` and ``vllite serve org/name``.

A local stand-in for the Hub (``hf_hub_support.FakeHub``, reached through ``HF_ENDPOINT``) serves tiny models: the
id is resolved once, in the frontend, to a snapshot folder in the Hugging Face cache holding only the files the
engine reads; the engine processes get that folder; the served name stays the id. Offline (``HF_HUB_OFFLINE=1``) a
cached copy serves, and greedy tokens equal Hugging Face ``generate()`` on the same model. Each failure is one
``ModelLoadError`` naming the id.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import pytest
import torch
from hf_hub_support import RECORD_ENV, FakeHub, folder_files

from vllite import LLM, EngineArgs, SamplingParams
from vllite.exceptions import ModelLoadError
from vllite.testing import make_tiny_model

REPO = "org/tiny"
MAX_TOKENS = 8
EXTRA_FILES = {  # in the repository, never downloaded
    "pytorch_model.bin": b"not used: the repository has safetensors",
    "model.gguf": b"gguf",
    "onnx/model.onnx": b"onnx",
    "original/params.json": b"{}",
    "README.md": b"# tiny",
}
ENGINE_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
TOKENIZER_FILES = [name for name in ENGINE_FILES if name != "model.safetensors"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The model at ``main`` (2 layers) and at tag ``v1`` (1 layer, other weights)."""
    root = tmp_path_factory.mktemp("hub-models")
    return {
        "main": make_tiny_model("llama", root / "main", seed=0),
        "v1": make_tiny_model("llama", root / "v1", seed=1, num_layers=1),
    }


@pytest.fixture(scope="module")
def hub(models):
    fake = FakeHub()
    fake.add_commit(REPO, {**folder_files(models["main"]), **EXTRA_FILES})
    fake.add_commit(REPO, folder_files(models["v1"]), refs=("v1",))
    fake.add_commit("org/gated", folder_files(models["main"]))
    fake.repos["org/gated"].gated_token = "hf_granted"
    bin_only = {n: d for n, d in folder_files(models["main"]).items() if not n.endswith(".safetensors")}
    fake.add_commit("org/bin-only", {**bin_only, "pytorch_model.bin": b"weights", "model.gguf": b"gguf"})
    yield fake
    fake.close()


@pytest.fixture(autouse=True)
def hub_env(monkeypatch, hub):
    """The fake Hub as the endpoint, no token, online, progress bars off (they would go to the test log)."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def snapshot(cache: Path, repo: str, hub: FakeHub, ref: str = "main") -> str:
    return str(cache / f"models--{repo.replace('/', '--')}" / "snapshots" / hub.repos[repo].refs[ref])


def model_config(model: str, cache: Path, **kwargs):
    return EngineArgs(model=model, download_dir=str(cache), **kwargs).create_engine_config().model_config


def prompts_and_hf_greedy(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Six token prompts and Hugging Face ``generate()``'s greedy continuation of each (the oracle)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(10, model.config.vocab_size) for _ in range(rng.randint(3, 20))] for _ in range(6)]
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        outs = [model.generate(torch.tensor([p]), generation_config=config)[0, len(p) :].tolist() for p in prompts]
    return prompts, outs


# ---------------------------------------------------------------------------- what is downloaded
def test_a_hub_id_becomes_its_snapshot_folder_with_only_the_engines_files(hub, tmp_path):
    config = model_config(REPO, tmp_path)
    folder = snapshot(tmp_path, REPO, hub)
    assert config.model == config.tokenizer == folder
    assert config.revision is None and config.tokenizer_revision is None
    assert config.hf_config.num_hidden_layers == 2  # read from the snapshot
    assert sorted(hub.downloaded(REPO)) == ENGINE_FILES  # no .bin beside safetensors, no gguf, onnx, original/
    assert sorted(folder_files(folder)) == ENGINE_FILES
    before = len(hub.requests)
    assert model_config(REPO, tmp_path).model == folder  # cached: the files are not fetched again
    assert [r for r in hub.requests[before:] if r[0] == "GET" and "/resolve/" in r[1]] == []


def test_revision_picks_its_snapshot(hub, models, tmp_path):
    config = model_config(REPO, tmp_path, revision="v1")
    assert config.model == snapshot(tmp_path, REPO, hub, "v1") != snapshot(tmp_path, REPO, hub, "main")
    assert config.revision == config.tokenizer_revision == "v1"
    assert config.hf_config.num_hidden_layers == 1
    assert folder_files(config.model) == folder_files(models["v1"])


def test_pytorch_bin_weights_only_when_there_are_no_safetensors(hub, tmp_path):
    config = model_config("org/bin-only", tmp_path)
    assert sorted(folder_files(config.model)) == sorted([*TOKENIZER_FILES, "pytorch_model.bin"])


def test_a_tokenizer_id_downloads_no_weights(hub, models, tmp_path):
    config = model_config(str(models["main"]), tmp_path, tokenizer=REPO, tokenizer_revision="v1")
    assert config.model == str(models["main"]) and config.revision is None
    assert config.tokenizer == snapshot(tmp_path, REPO, hub, "v1") and config.tokenizer_revision == "v1"
    assert sorted(folder_files(config.tokenizer)) == TOKENIZER_FILES


def test_hf_token_opens_a_gated_repository(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    assert sorted(folder_files(model_config("org/gated", tmp_path).model)) == ENGINE_FILES


def test_names_that_are_not_hub_ids_are_left_to_the_engine(hub, tmp_path):
    before = len(hub.requests)
    for name in ("sim", "./org/tiny", "/no/such/folder"):  # a bare name, paths: never looked up
        assert model_config(name, tmp_path, skip_tokenizer_init=True).model == name
    assert len(hub.requests) == before


# ---------------------------------------------------------------------------- errors
def test_errors_name_the_id_and_say_what_to_do(hub, tmp_path, monkeypatch):
    def error(model: str, **kwargs) -> str:
        with pytest.raises(ModelLoadError) as caught:
            model_config(model, tmp_path, **kwargs)
        return str(caught.value)

    assert error("org/missing") == (
        "Model 'org/missing' is not a local folder, and the Hugging Face Hub has no repository of that name (or it "
        "is private: set HF_TOKEN to a token that can read it)."
    )
    assert error("org/gated") == (
        "Model 'org/gated' is a gated repository on the Hugging Face Hub: request access on the model's Hub page, "
        "then set HF_TOKEN to a token of an account that has it."
    )
    assert error("org/tiny", revision="v9") == (
        "Model 'org/tiny' has no revision 'v9' on the Hugging Face Hub: --revision takes a branch, a tag or a "
        "commit hash of the repository."
    )
    assert error(str(tmp_path), tokenizer="org/tiny", tokenizer_revision="v9").startswith(
        "Tokenizer 'org/tiny' has no revision 'v9' on the Hugging Face Hub: --tokenizer-revision takes"
    )
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert error("org/gated") == (
        "Model 'org/gated' is a gated repository on the Hugging Face Hub: the token in HF_TOKEN has no access to "
        "it; request access on the model's Hub page."
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.requests)
    assert error("org/tiny", revision="v1") == (
        f"Model 'org/tiny' (revision 'v1') is not a local folder and not (completely) in the Hugging Face cache "
        f"'{tmp_path}', and HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE, or download it while "
        "online first."
    )
    assert len(hub.requests) == before


def test_an_unreachable_hub_without_a_cached_copy(tmp_path, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    with pytest.raises(ModelLoadError) as caught:
        model_config(REPO, tmp_path)
    assert str(caught.value) == (
        f"Model 'org/tiny' is not a local folder, the Hugging Face Hub ({dead}) cannot be reached to download it, "
        f"and it is not (completely) in the cache '{tmp_path}'. Check the network (or HF_ENDPOINT), or pass a local "
        "model folder."
    )


# ---------------------------------------------------------------------------- LLM offline, serve online
def test_llm_from_the_cache_offline_equals_hf_generate(hub, models, tmp_path, monkeypatch):
    model_config(REPO, tmp_path)  # fills the cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.requests)
    prompts, expected = prompts_and_hf_greedy(models["main"])
    llm = LLM(REPO, download_dir=str(tmp_path), dtype="float32", max_model_len=256)
    try:
        assert llm.llm_engine.config.model_config.model == snapshot(tmp_path, REPO, hub)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert len(hub.requests) == before  # offline: not one request


def test_serve_a_hub_id_with_two_engines(hub, models, tmp_path):
    """``vllite serve org/tiny -dp 2``: downloaded once, by the frontend; each engine process is given the snapshot
    folder; both answer HF's greedy tokens; ``/v1/models`` lists the id as typed."""
    openai = pytest.importorskip("openai")
    from vllite.plugins.openai_server.testing import RemoteServer

    records = tmp_path / "records"
    records.mkdir()
    tests_dir = str(Path(__file__).resolve().parent)
    env = {
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_ENDPOINT": hub.url,
        "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
        RECORD_ENV: str(records),
    }
    args = [REPO, "-dp", "2", "--dtype", "float32", "--max-model-len", "256", "--cpu-kvcache-space", "0.05"]
    args += ["--executor", "hf_hub_support:PathRecordingExecutor"]
    prompts, expected = prompts_and_hf_greedy(models["main"])
    before = len(hub.requests)
    with (
        RemoteServer(args, env=env) as server,
        openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client,
    ):
        assert [m.id for m in client.models.list().data] == [REPO]
        for rank in (0, 1):
            response = client.completions.create(
                model=REPO,
                prompt=prompts[rank],
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True, "vllm_xargs": {"data_parallel_rank": rank}},
            )
            assert response.model == REPO
            assert response.choices[0].model_extra["token_ids"] == expected[rank]
    folder = snapshot(tmp_path / "hf-home" / "hub", REPO, hub)
    engines = sorted(records.iterdir())
    assert len(engines) == 2 and [path.read_text() for path in engines] == [folder, folder]
    requests = hub.requests[before:]
    assert requests.count(("GET", f"/api/models/{REPO}")) == 1  # resolved once, for the whole process tree
    fetched = [
        path.split("/resolve/")[1].split("/", 1)[1]
        for method, path in requests
        if method == "GET" and "/resolve/" in path
    ]
    assert sorted(fetched) == ENGINE_FILES  # each file once, by the frontend
