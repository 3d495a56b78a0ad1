"""Engine-process shutdown is prompt and clean every time: no kill after a timeout, no lingering, no leaks.

Regressions: SIGTERM once went unnoticed by an idle engine (its Python-level handler never ran while the main
thread slept in ``input_queue.get()``), so about one ``shutdown()`` in three waited 5 s and killed the child; the
client closed its output socket before stopping the engine, so an engine with requests in flight lingered 4 s on
its last outputs; and a named semaphore created in the engine process (tqdm's lock) was reported as leaked.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import time

import pytest

from tests.test_engine_proc import Collector, expected_tokens, make_config, request
from vllite.executor import ModelInfo
from vllite.testing import PositionTokenExecutor

# Far below the client's kill fallback (shutdown_timeout_s + 5 s) and the engine's 4 s socket linger.
FAST_SHUTDOWN_S = 2.0


class SemaphoreProbeExecutor(PositionTokenExecutor):
    """Creates a named multiprocessing semaphore (as tqdm does while weights load) and records its name."""

    def _init_executor(self) -> ModelInfo:
        model_info = super()._init_executor()
        probe = dict(self.config.plugin_config.get("semaphore_probe") or {})
        self._lock = multiprocessing.get_context("spawn").RLock()
        with open(probe["path"], "w") as f:
            json.dump({"name": self._lock._semlock.name, "pid": os.getpid()}, f)
        return model_info


def _shutdown_timed(client) -> float:
    start = time.monotonic()
    client.shutdown()
    return time.monotonic() - start


def test_repeated_start_generate_shutdown_is_fast_and_clean(caplog):
    from vllite.plugins.engine_proc.client import SyncMPClient

    caplog.set_level(logging.WARNING, logger="vllite.plugins.engine_proc.client")
    for i in range(4):
        client = SyncMPClient(make_config())
        try:
            col = Collector(client)
            client.add_request(request(f"s-{i}", max_tokens=4))
            col.until_finished(f"s-{i}")
            assert col.tokens[f"s-{i}"] == expected_tokens(4, 4)
        finally:
            elapsed = _shutdown_timed(client)
        proc = client.resources.proc
        assert elapsed < FAST_SHUTDOWN_S, f"round {i}: shutdown took {elapsed:.2f}s"
        assert proc.exitcode == 0, f"round {i}: engine exit code {proc.exitcode} (killed?)"
        assert not client.resources.output_thread.is_alive()
    assert "did not exit in time" not in caplog.text


def test_shutdown_with_requests_in_flight_is_fast_and_clean():
    from vllite.plugins.engine_proc.client import SyncMPClient

    client = SyncMPClient(make_config(step_delay_s=0.01))
    try:
        col = Collector(client)
        client.add_request(request("f-1", max_tokens=5000))
        client.add_request(request("f-2", max_tokens=5000))
        col.until_tokens("f-1")
    finally:
        elapsed = _shutdown_timed(client)
    assert elapsed < FAST_SHUTDOWN_S, f"shutdown took {elapsed:.2f}s"
    assert client.resources.proc.exitcode == 0


def test_shutdown_after_signal_while_idle_is_acted_on_at_once():
    """SIGTERM to an idle engine (main thread blocked on its input queue) ends it well within a second."""
    from vllite.plugins.engine_proc.client import SyncMPClient

    client = SyncMPClient(make_config())
    try:
        col = Collector(client)
        client.add_request(request("i-1", max_tokens=2))
        col.until_finished("i-1")
        for _ in range(3):  # let the busy loop settle into its blocking get()
            client.call_utility("is_sleeping")
        proc = client.resources.proc
        start = time.monotonic()
        proc.terminate()
        proc.join(timeout=FAST_SHUTDOWN_S)
        assert time.monotonic() - start < FAST_SHUTDOWN_S
        assert proc.exitcode == 0
    finally:
        client.shutdown()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="named semaphores are not visible under /dev/shm")
def test_semaphore_created_in_the_engine_is_unlinked_on_exit(tmp_path):
    from vllite.engine_args import EngineArgs
    from vllite.plugins.engine_proc.client import SyncMPClient

    probe = tmp_path / "semaphore.json"
    config = EngineArgs(
        executor=f"{__name__}:SemaphoreProbeExecutor",
        skip_tokenizer_init=True,
        max_model_len=256,
        plugin_config={"semaphore_probe": {"path": str(probe)}},
    ).create_engine_config()
    client = SyncMPClient(config)
    try:
        name = json.loads(probe.read_text())["name"]
        path = os.path.join("/dev/shm", "sem." + name.lstrip("/"))
        assert os.path.exists(path)
    finally:
        elapsed = _shutdown_timed(client)
    assert client.resources.proc.exitcode == 0
    assert elapsed < FAST_SHUTDOWN_S
    assert not os.path.exists(path), "the engine process left its semaphore for the resource tracker"


def _exit_with(code: int) -> None:
    os._exit(code)


@pytest.mark.parametrize("how", ["exit 3", "SIGKILL"])
def test_peek_exit_code_reads_the_status_and_leaves_the_reaping_to_the_owner(how):
    """Regression: the client's output thread reaped an exited engine with ``proc.exitcode`` while the owner was in
    ``join``, which then returned with no exit code (``test_shutdown_after_signal...`` failed one run in five)."""
    from vllite.plugins.engine_proc.utils import peek_exit_code

    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_exit_with if how == "exit 3" else time.sleep, args=(3,) if how == "exit 3" else (60,))
    proc.start()
    if how == "SIGKILL":
        assert peek_exit_code(proc) is None
        proc.kill()
    multiprocessing.connection.wait([proc.sentinel], timeout=30)
    expected = 3 if how == "exit 3" else -9
    deadline = time.monotonic() + 10
    while (code := peek_exit_code(proc)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert code == expected
    assert proc._popen.returncode is None  # nothing reaped it: the child is still waitable
    assert os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    proc.join(timeout=10)
    assert proc.exitcode == expected  # the owner's join gets the code
    assert peek_exit_code(proc) == expected  # and afterwards the Popen's record answers
