"""Engine-process failures and shutdowns: SIGKILL, executor failure, SIGTERM with and without a drain timeout,
and the sync ``LLM`` frontend on the multiprocess client."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from tests.test_engine_proc import Collector, ensure_engine_proc_plugin, expected_tokens, make_config, request
from vllite.exceptions import EngineDeadError
from vllite.protocol import FinishReason


def _client(**kwargs):
    from vllite.plugins.engine_proc.client import SyncMPClient

    return SyncMPClient(make_config(**kwargs))


def test_sigkill_mid_generation_raises_engine_dead_everywhere_within_5s():
    client = _client(step_delay_s=0.005)
    try:
        col = Collector(client)
        client.add_request(request("k-1", max_tokens=10_000 // 50))
        col.until_tokens("k-1")
        errors: list[BaseException] = []

        def blocked_utility() -> None:  # waits for the engine to drain: would hang forever without death handling
            try:
                client.call_utility("pause_scheduler", "wait")
            except BaseException as exc:
                errors.append(exc)

        waiter = threading.Thread(target=blocked_utility)
        waiter.start()
        killed_at = time.monotonic()
        os.kill(client.resources.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            while True:
                col.pump()
        waiter.join(timeout=5)
        assert time.monotonic() - killed_at < 5
        assert not waiter.is_alive() and isinstance(errors[0], EngineDeadError)
        with pytest.raises(EngineDeadError):  # sticky
            client.get_output()
        with pytest.raises(EngineDeadError):
            client.add_request(request("k-2"))
        with pytest.raises(EngineDeadError):
            client.call_utility("is_sleeping")
        client.abort_requests(["k-1"])  # silently ignored once dead
    finally:
        client.shutdown()
    assert client.resources.closed


@pytest.mark.parametrize("option", ["fail_at_step", "report_failure_at_step"])
def test_executor_failure_announces_engine_core_dead(option):
    client = _client(plugin_config={"fake_executor": {option: 3}})
    try:
        col = Collector(client)
        client.add_request(request("f-1", max_tokens=50))
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            while True:
                col.pump()
        assert time.monotonic() - start < 5
        client.resources.proc.join(timeout=10)
        assert client.resources.proc.exitcode == 1
    finally:
        client.shutdown()


def test_sigterm_with_drain_timeout_finishes_in_flight_requests():
    client = _client(step_delay_s=0.01, plugin_config={"engine_proc": {"shutdown_timeout_s": 30}})
    try:
        col = Collector(client)
        client.add_request(request("d-1", max_tokens=40))
        client.add_request(request("d-2", prompt_len=7, max_tokens=25))
        col.until_tokens("d-1")
        client.resources.proc.terminate()
        col.until_finished("d-1", "d-2")
        assert col.tokens["d-1"] == expected_tokens(4, 40)
        assert col.tokens["d-2"] == expected_tokens(7, 25)
        assert col.finish == {"d-1": FinishReason.LENGTH, "d-2": FinishReason.LENGTH}
        client.resources.proc.join(timeout=10)
        assert client.resources.proc.exitcode == 0  # a clean exit, not a death
    finally:
        client.shutdown()


def test_sigterm_without_drain_timeout_aborts_at_once():
    client = _client(step_delay_s=0.01)
    try:
        col = Collector(client)
        client.add_request(request("z-1", max_tokens=5000))
        col.until_tokens("z-1")
        client.resources.proc.terminate()
        col.until_finished("z-1")
        assert col.finish["z-1"] == FinishReason.ABORT
        client.resources.proc.join(timeout=10)
        assert client.resources.proc.exitcode == 0
    finally:
        client.shutdown()


@pytest.mark.parametrize("how", ["sigterm", "sigterm_during_drain"])
def test_an_engine_told_to_stop_is_not_reported_as_an_unexpected_death(how, caplog):
    """SIGTERM to the process group (``docker stop``, systemd) reaches the engine core too: it drains and exits 0.
    That is a shutdown on request, logged as one; the client's calls then fail with an error that says so."""
    caplog.set_level(logging.INFO, logger="vllite.plugins.engine_proc")
    drain = {"engine_proc": {"shutdown_timeout_s": 30}} if how == "sigterm_during_drain" else {}
    client = _client(step_delay_s=0.01, plugin_config=drain)
    try:
        col = Collector(client)
        client.add_request(request("t-1", max_tokens=30))
        col.until_tokens("t-1")
        os.kill(client.resources.proc.pid, signal.SIGTERM)
        with pytest.raises(EngineDeadError) as info:
            while True:
                col.pump()
        client.resources.proc.join(timeout=10)
        assert client.resources.proc.exitcode == 0
    finally:
        client.shutdown()
    assert "unexpectedly" not in caplog.text and "unexpectedly" not in str(info.value), caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "shut down on request" in str(info.value), info.value
    assert "The engine core process shut down on request" in caplog.text, caplog.text


def test_llm_uses_the_multiprocess_client_by_default(monkeypatch):
    from vllite import LLM, SamplingParams
    from vllite.plugin_manager import reset_plugin_manager
    from vllite.plugins.engine_proc.client import SyncMPClient

    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")
    reset_plugin_manager()
    ensure_engine_proc_plugin()
    try:
        llm = LLM(
            executor="vllite.testing.executors:PositionTokenExecutor",
            skip_tokenizer_init=True,
            max_model_len=128,
        )
        try:
            assert isinstance(llm.llm_engine.engine_core, SyncMPClient)
            params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
            outputs = llm.generate([[1, 2, 3], [5, 6, 7, 8, 9]], params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == [expected_tokens(3, 4), expected_tokens(5, 4)]
        finally:
            llm.shutdown()
    finally:
        reset_plugin_manager()
