"""The engine's health diagnostics, as vLLM's:

- NaN counting (``$VLLITE_COMPUTE_NANS_IN_LOGITS`` / ``$VLLM_COMPUTE_NANS_IN_LOGITS``): the executor fills each
  request's ``EngineCoreOutput.num_nans_in_logits``, and the server counts the finished requests that had NaN
  logits in ``corrupted_requests`` (under either metric prefix), while the other requests are unaffected;
- the dump of a step that raises (``dump_engine_exception``): logged once, naming the step's requests, and the
  exception goes on as before;
- ``--enable-logging-iteration-details``: one line per step with its context and generation requests and tokens.

The NaN model is the tiny test model with one token's embedding row set to NaN: a prompt holding that token gets
NaN logits, any other prompt finite ones.
"""

from __future__ import annotations

import logging
import shutil
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllite.config import CacheConfig, EngineConfig, ModelConfig, ObservabilityConfig
from vllite.engine.core import EngineCore
from vllite.engine_args import EngineArgs
from vllite.exceptions import ModelExecutionError
from vllite.protocol import EngineCoreRequest
from vllite.sampling_params import SamplingParams
from vllite.testing import make_tiny_model_dir_cached

POISON = 77
NAN_PROMPT = [5, 9, POISON, 31, 32]
CLEAN_PROMPT = [100, 7, 64, 12]
FAKE = "vllite.testing.executors:PositionTokenExecutor"


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory) -> str:
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("nan-model")
    shutil.copytree(make_tiny_model_dir_cached("llama"), folder, dirs_exist_ok=True)
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][POISON] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def request(request_id: str, prompt: list[int], max_tokens: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, 0.0)


def nans_per_request(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    """Steps ``requests`` to completion; each request's ``num_nans_in_logits`` of every output it got."""
    for r in requests:
        core.add_request(r)
    nans: dict[str, list[int]] = {}
    while core.scheduler.has_requests():
        outputs, _ = core.step()
        for output in outputs[0].outputs if 0 in outputs else []:
            nans.setdefault(output.request_id, []).append(output.num_nans_in_logits)
    return nans


# ------------------------------------------------------------------------------------------------ NaN counting
@pytest.mark.parametrize("env", ["VLLITE_COMPUTE_NANS_IN_LOGITS", "VLLM_COMPUTE_NANS_IN_LOGITS", None])
def test_executor_counts_nan_logits_per_request(nan_model, monkeypatch, env):
    for name in ("VLLITE_COMPUTE_NANS_IN_LOGITS", "VLLM_COMPUTE_NANS_IN_LOGITS"):
        monkeypatch.delenv(name, raising=False)
    if env is not None:
        monkeypatch.setenv(env, "1")
    config = EngineArgs(model=nan_model, dtype="float32", max_model_len=64, block_size=16).create_engine_config()
    assert config.observability_config.compute_nans_in_logits is (env is not None)
    core = EngineCore(config)
    try:
        nans = nans_per_request(core, [request("nan", NAN_PROMPT), request("clean", CLEAN_PROMPT)])
    finally:
        core.shutdown()
    vocab = core.info.vocab_size
    assert len(nans["nan"]) == len(nans["clean"]) == 3  # both ran to the end
    assert nans["clean"] == [0, 0, 0]
    assert nans["nan"] == ([vocab] * 3 if env is not None else [0, 0, 0])


def test_corrupted_requests_counted_once_per_finished_request_under_the_default_prefix(monkeypatch):
    from vllite.engine.stats import IterationStats, RequestStateStats
    from vllite.plugins.openai_server.observability.metrics import PrometheusStatLogger
    from vllite.protocol import EngineInfo

    info = EngineInfo(max_model_len=64, num_gpu_blocks=8, block_size=16, max_num_batched_tokens=64, vocab_size=512)
    monkeypatch.setenv("VLLITE_COMPUTE_NANS_IN_LOGITS", "1")
    metrics = PrometheusStatLogger("tiny", info)
    corrupted, clean = RequestStateStats(arrival_time=0.0), RequestStateStats(arrival_time=0.0)
    corrupted.is_corrupted = True
    it = IterationStats()
    for stats in (corrupted, clean):
        it.record_finished("length", 4, stats)
    metrics.record(None, it)
    body = metrics.render()[0].decode()
    assert 'vllite:corrupted_requests_total{engine="0",model_name="tiny"} 1.0' in body
    monkeypatch.delenv("VLLITE_COMPUTE_NANS_IN_LOGITS")
    body = PrometheusStatLogger("tiny", info).render()[0]
    assert b"corrupted_requests" not in body  # as vLLM: not exported unless NaN logits are counted


@pytest.fixture(scope="module")
def server(nan_model):
    from vllite.plugins.openai_server.testing import RemoteServer

    args = [nan_model, "--served-model-name", "tiny", "--max-model-len", "64", "--dtype", "float32"]
    env = {"VLLM_COMPUTE_NANS_IN_LOGITS": "1"}  # vLLM's name is honoured too
    with RemoteServer([*args, "--metrics-prefix", "vllm", "--enable-logging-iteration-details"], env=env) as remote:
        yield remote


def completion(server, prompt: list[int]) -> dict:
    import json

    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    body["return_token_ids"] = True
    request = urllib.request.Request(
        server.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_serve_counts_the_corrupted_request_and_serves_the_other(server, nan_model):
    import torch
    from transformers import AutoModelForCausalLM

    with ThreadPoolExecutor(2) as pool:  # in one batch
        clean, _ = pool.map(lambda prompt: completion(server, prompt), [CLEAN_PROMPT, NAN_PROMPT])
    hf = AutoModelForCausalLM.from_pretrained(nan_model, dtype=torch.float32).eval()
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([CLEAN_PROMPT]), max_new_tokens=3, do_sample=False, min_new_tokens=3)
    assert clean["choices"][0]["token_ids"] == greedy[0, len(CLEAN_PROMPT) :].tolist()
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    assert 'vllm:corrupted_requests_total{engine="0",model_name="tiny"} 1.0' in text


def test_serve_logs_iteration_details(server):
    completion(server, CLEAN_PROMPT)
    log = "".join(server.log)
    assert "1 context requests, 4 context tokens, 0 generation requests, 0 generation tokens" in log
    assert "0 context requests, 0 context tokens, 1 generation requests, 1 generation tokens" in log


# ------------------------------------------------------------------------------------------------ engine dump
def fake_core(**options) -> EngineCore:
    config = EngineConfig(
        model_config=ModelConfig(max_model_len=256),
        cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=64),
        observability_config=ObservabilityConfig(
            enable_logging_iteration_details=options.pop("iteration_details", False)
        ),
        executor=FAKE,
        plugin_config={"fake_executor": options},
    )
    return EngineCore(config)


def test_a_step_that_raises_is_dumped_once_then_raises_as_before(caplog):
    core = fake_core(fail_at_step=2)
    core.add_request(request("req-a", [10, 11, 12, 13], max_tokens=5))
    core.add_request(request("req-b", [20, 21], max_tokens=5))
    core.step()
    with caplog.at_level(logging.ERROR, logger="vllite"), pytest.raises(ModelExecutionError, match="injected"):
        core.step()
    dumps = [r for r in caplog.records if "Dumping input data of the failed engine step" in r.getMessage()]
    assert len(dumps) == 1
    message = dumps[0].getMessage()
    assert "'req-a': status=RUNNING prompt=4 computed=5 output=1" in message
    assert "'req-b': status=RUNNING prompt=2 computed=3 output=1" in message
    assert "'num_scheduled_tokens': {'req-a': 1, 'req-b': 1}" in message
    assert "[10, 11, 12, 13]" not in message  # prompts are dumped as their lengths


def test_a_step_that_runs_logs_no_dump(caplog):
    core = fake_core()
    with caplog.at_level(logging.INFO, logger="vllite"):
        nans_per_request(core, [request("ok", [1, 2, 3])])
    assert not any("Dumping" in r.getMessage() or "Iteration(" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------------ iteration details
def test_iteration_details_are_logged_per_step_when_on(caplog):
    core = fake_core(iteration_details=True)
    with caplog.at_level(logging.INFO, logger="vllite"):
        nans_per_request(core, [request("a", [1, 2, 3, 4, 5], max_tokens=2), request("b", [6, 7], max_tokens=2)])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Iteration(")]
    assert len(lines) == 2
    assert lines[0].startswith(
        "Iteration(0): 2 context requests, 7 context tokens, 0 generation requests, 0 generation tokens, "
        "iteration elapsed time: "
    )
    assert lines[1].startswith("Iteration(1): 0 context requests, 0 context tokens, 2 generation requests, 2 ")
    assert lines[1].endswith(" ms")


def test_iteration_details_flag_reaches_the_config():
    on = EngineArgs(enable_logging_iteration_details=True).create_engine_config()
    assert on.observability_config.enable_logging_iteration_details
    assert not EngineArgs().create_engine_config().observability_config.enable_logging_iteration_details
