"""``LLM.start_profile`` / ``stop_profile`` (a ``torch.profiler`` trace written by the engine process) and
``LLM.collective_rpc`` (vLLM's worker RPC: a method name on every worker, or in-process a callable), offline."""

from __future__ import annotations

import pytest

from vllite import LLM, SamplingParams
from vllite.executor import Executor

EXTENSION = "vllite.testing.worker_extension:EchoWorkerExtension"


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=256, worker_extension_cls=EXTENSION) as engine:  # vLLM's --worker-extension-cls
        yield engine


def test_collective_rpc_calls_a_worker_method_by_name_in_the_engine_process(llm):
    assert llm.collective_rpc("check_health") == [None]
    echoed = llm.collective_rpc("echo_args_kwargs", args=(1, "two"), kwargs={"three": [3]})
    assert echoed == [{"args": [1, "two"], "kwargs": {"three": [3]}}]
    # the extension reaches the executor's attributes, as vLLM's worker extensions reach the worker's
    assert llm.collective_rpc("model_max_len") == [256]


def test_collective_rpc_unknown_or_private_method_is_refused_naming_it(llm):
    with pytest.raises(Exception, match="no worker method 'no_such_method'"):
        llm.collective_rpc("no_such_method")
    with pytest.raises(Exception, match="no worker method '_sleep'"):
        llm.collective_rpc("_sleep")
    with pytest.raises(Exception, match="timeout must be > 0"):
        llm.collective_rpc("check_health", timeout=0)
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids  # still alive


def test_profile_writes_a_trace_into_the_profiler_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))  # vLLM's name works too; the engine inherits it
    with LLM(max_model_len=256) as engine:
        engine.start_profile()
        with pytest.raises(Exception, match="already running"):
            engine.start_profile()
        engine.generate(["Hello there"], SamplingParams(max_tokens=4), use_tqdm=False)
        engine.stop_profile()
        with pytest.raises(Exception, match="not running"):
            engine.stop_profile()
    traces = list(tmp_path.glob("*.pt.trace.json.gz"))
    assert len(traces) == 1 and traces[0].name.startswith("vllite-engine0")
    assert traces[0].stat().st_size > 0


def test_profile_without_a_directory_says_which_variable_to_set(monkeypatch):
    monkeypatch.delenv("VLLITE_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with LLM(max_model_len=256) as engine, pytest.raises(Exception, match="VLLITE_TORCH_PROFILER_DIR"):
        engine.start_profile()


def test_collective_rpc_callable_in_process(monkeypatch):
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    with LLM(max_model_len=256) as engine:

        def describe(worker, scale, *, offset=0):
            assert isinstance(worker, Executor)
            return worker.model_info.max_model_len * scale + offset

        assert engine.collective_rpc(describe, args=(2,), kwargs={"offset": 1}) == [513]
