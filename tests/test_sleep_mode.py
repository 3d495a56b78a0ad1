"""``enable_sleep_mode`` / ``--enable-sleep-mode`` (vLLM's, default off): ``sleep`` (levels 1, 2) and ``wake_up`` of
``weights`` / ``kv_cache`` are refused, naming the flag, unless the engine started with it, through ``LLM``, an
engine utility call and ``vllite serve``'s dev-mode ``/sleep`` route; the engine serves on after a refusal. Level 0
(a pause) and a plain ``wake_up()`` (resume) need no flag. With the flag they work (tests/test_engine_pause_sleep.py,
tests/test_server_ops.py, and across API servers in tests/test_api_server_count.py)."""

from __future__ import annotations

import pytest
from http_client import request

from vllite import LLM, SamplingParams
from vllite.engine_args import EngineArgs
from vllite.exceptions import UtilityCallError

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [{"prompt_token_ids": [5, 6, 7]}]
FAKE = "vllite.testing.executors:PositionTokenExecutor"


def _llm(**kwargs) -> LLM:
    return LLM(executor=FAKE, skip_tokenizer_init=True, max_model_len=128, **kwargs)


def test_sleep_mode_is_off_by_default_as_in_vllm():
    assert EngineArgs().enable_sleep_mode is False
    with _llm() as llm:
        assert llm.llm_engine.config.model_config.enable_sleep_mode is False


@pytest.mark.parametrize("multiprocess", ["0", "1"])
def test_llm_without_sleep_mode_refuses_to_sleep_and_keeps_serving(multiprocess, monkeypatch):
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", multiprocess)  # in-process engine, or its own process
    with _llm() as llm:
        before = llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        with pytest.raises(ValueError, match=r"sleep\(level=1\) needs sleep mode: .*enable_sleep_mode=True"):
            llm.sleep()
        with pytest.raises(ValueError, match=r"--enable-sleep-mode"):
            llm.sleep(level=2)
        with pytest.raises(ValueError, match=r"wake_up\(tags=\['weights'\]\) needs sleep mode"):
            llm.wake_up(tags=["weights"])
        # The engine checks too (any client, any frontend): in-process a ValueError, over RPC a UtilityCallError.
        with pytest.raises((ValueError, UtilityCallError), match="enable_sleep_mode=True"):
            llm.llm_engine.engine_core.call_utility("sleep", 1, "abort")
        assert llm.llm_engine.is_sleeping() is False
        llm.sleep(level=0)  # a pause frees nothing: allowed
        assert llm.llm_engine.is_scheduler_paused() is True
        llm.wake_up()
        assert llm.llm_engine.is_scheduler_paused() is False
        assert llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == before


def test_llm_with_sleep_mode_sleeps_and_wakes():
    with _llm(enable_sleep_mode=True) as llm:
        before = llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        llm.sleep(level=1)
        assert llm.llm_engine.is_sleeping() is True
        llm.wake_up()
        assert llm.llm_engine.is_sleeping() is False
        assert llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.parametrize("multiprocess", ["0", "1"])
def test_resuming_a_sleeping_engine_is_refused_and_keeps_it(multiprocess, monkeypatch):
    """A resume while the weights and KV cache are gone would run a step on nothing (ExecutorAsleepError killed the
    engine): it is refused, naming wake_up, and the engine wakes up and serves as before."""
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", multiprocess)
    with _llm(enable_sleep_mode=True) as llm:
        before = llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        llm.sleep(level=1)
        with pytest.raises((ValueError, UtilityCallError), match=r"asleep: wake_up\(\)"):
            llm.llm_engine.resume_scheduler()
        with pytest.raises((ValueError, UtilityCallError), match="asleep"):
            llm.wake_up(tags=["scheduling"])
        assert llm.llm_engine.is_sleeping() is True
        llm.wake_up()
        assert llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == before


def test_vllite_serve_without_sleep_mode_answers_400_on_sleep():
    from vllite.plugins.openai_server.testing import RemoteServer

    server = RemoteServer(["--max-model-len", "256"], env={"VLLITE_SERVER_DEV_MODE": "1"})  # no --enable-sleep-mode
    try:
        answer = request("POST", server.url + "/sleep", params={"level": 1})
        assert answer.status_code == 400, answer.text
        assert "--enable-sleep-mode" in answer.json()["error"]["message"]
        answer = request("POST", server.url + "/wake_up", params={"tags": "kv_cache"})
        assert answer.status_code == 400 and "--enable-sleep-mode" in answer.json()["error"]["message"]
        assert request("GET", server.url + "/is_sleeping").json() == {"is_sleeping": False}
        body = {"model": "vllite-demo", "prompt": "Hello", "max_tokens": 3}
        assert request("POST", server.url + "/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
    finally:
        assert server.stop() == 0
