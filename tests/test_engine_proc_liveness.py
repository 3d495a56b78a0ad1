"""Engine-process liveness and errors that explain: heartbeats, a hung (SIGSTOPped) engine, the fatal cause carried
across the process boundary, and start-up failures naming their real cause (issue 13)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.test_engine_proc import Collector, expected_tokens, make_config, request
from vllite.exceptions import EngineDeadError, EngineStartupError
from vllite.testing.executors import PositionTokenExecutor


def _client(**kwargs):
    from vllite.plugins.engine_proc.client import SyncMPClient

    return SyncMPClient(make_config(**kwargs))


class StartupFailingExecutor(PositionTokenExecutor):
    """Fails while the engine process starts (as a model that cannot load would)."""

    def _init_executor(self):
        raise OSError("weights file model-00001.safetensors is truncated (startup-cause-42)")


def test_sigstopped_engine_is_declared_dead_within_the_heartbeat_timeout():
    client = _client(step_delay_s=0.002, plugin_config={"engine_proc": {"heartbeat_timeout_s": 2.0}})
    pid = client.resources.proc.pid
    try:
        col = Collector(client)
        client.add_request(request("h-1", max_tokens=3))
        col.until_finished("h-1")
        errors: dict[str, BaseException] = {}

        def blocked_get_output() -> None:
            try:
                while True:
                    client.get_output()
            except BaseException as exc:
                errors["get_output"] = exc

        def pending_utility() -> None:
            try:
                client.call_utility("is_sleeping")
            except BaseException as exc:
                errors["utility"] = exc

        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        threads = [threading.Thread(target=blocked_get_output), threading.Thread(target=pending_utility)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        elapsed = time.monotonic() - stopped_at
        assert not any(thread.is_alive() for thread in threads)
        assert elapsed < 2.0 + 3.0
        for exc in errors.values():
            assert isinstance(exc, EngineDeadError)
            assert "unresponsive" in str(exc) and "heartbeat timeout 2 s" in str(exc)
        assert set(errors) == {"get_output", "utility"}
        client.resources.proc.join(timeout=10)
        assert not client.resources.proc.is_alive()  # killed by the client
        with pytest.raises(EngineDeadError, match="unresponsive"):
            client.add_request(request("h-2"))
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        client.shutdown()


def test_a_step_longer_than_the_heartbeat_timeout_is_not_a_hang():
    client = _client(step_delay_s=1.5, plugin_config={"engine_proc": {"heartbeat_timeout_s": 0.6}})
    try:
        col = Collector(client)
        client.add_request(request("slow-1", max_tokens=2))
        col.until_finished("slow-1")
        assert col.tokens["slow-1"] == expected_tokens(4, 2)
        assert not client.is_engine_dead
    finally:
        client.shutdown()


def test_an_idle_engine_stays_alive_past_the_heartbeat_timeout():
    client = _client(plugin_config={"engine_proc": {"heartbeat_timeout_s": 0.4}})
    try:
        assert not threading.Event().wait(1.2)  # idle: only heartbeats flow
        assert client.call_utility("is_sleeping") is False
        assert not client.is_engine_dead
    finally:
        client.shutdown()


def test_engine_dead_error_carries_the_fatal_cause():
    client = _client(plugin_config={"fake_executor": {"fail_at_step": 2}})
    try:
        col = Collector(client)
        client.add_request(request("f-1", max_tokens=20))
        with pytest.raises(EngineDeadError) as info:
            while True:
                col.pump()
        message = str(info.value)
        assert message.startswith("The engine core died: ")
        assert "PositionTokenExecutor: injected failure at step 2" in message
        with pytest.raises(EngineDeadError, match="injected failure at step 2"):  # sticky, with its cause
            client.call_utility("is_sleeping")
    finally:
        client.shutdown()


def test_startup_failure_names_the_real_cause():
    from vllite.engine_args import EngineArgs
    from vllite.plugins.engine_proc.client import SyncMPClient

    config = EngineArgs(
        executor=f"{__name__}:StartupFailingExecutor", skip_tokenizer_init=True, max_model_len=256
    ).create_engine_config()
    with pytest.raises(EngineStartupError) as info:
        SyncMPClient(config)
    message = str(info.value)
    assert "OSError: weights file model-00001.safetensors is truncated (startup-cause-42)" in message
    assert "__main__" not in message
