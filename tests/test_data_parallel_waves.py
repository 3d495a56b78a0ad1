"""The lockstep engine's wave rules on a ``DPEngineCoreProc`` with stand-ins for its engine, I/O and all-reduce
group (no process, no model): wave stamps on requests, START_DP_WAVE, the every-32-steps all-reduce, dummy steps,
wave completion, and an idle engine that finds work starting a wave."""

from __future__ import annotations

import queue
from types import SimpleNamespace
from typing import Any

from vllite.plugins.engine_proc.dp_core_proc import SYNC_EVERY_STEPS, DPEngineCoreProc
from vllite.protocol import EngineCoreOutputs, EngineCoreRequestType, EngineShutdownState


class FakeGroup:
    """An all-reduce that answers from a script: ``peers_unfinished`` is what the other engines report."""

    def __init__(self) -> None:
        self.calls: list[bool] = []
        self.peers_unfinished = False

    def any_unfinished(self, local_unfinished: bool) -> bool:
        self.calls.append(local_unfinished)
        return local_unfinished or self.peers_unfinished


class FakeEngine:
    """Just enough of ``EngineCore``: requests that finish after ``steps_per_request`` executed steps."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.paused = False
        self.dummy_steps = 0
        self.batch_queue = None
        self.scheduler = SimpleNamespace(has_unfinished_requests=lambda: bool(self.requests))
        self.model_executor = SimpleNamespace(execute_model=self._dummy)

    def _dummy(self, scheduler_output: Any) -> None:
        assert scheduler_output.total_num_scheduled_tokens == 0
        self.dummy_steps += 1

    def add_request(self, request: Any) -> None:
        self.requests[request.request_id] = 3

    def step_fn(self) -> tuple[dict, bool]:
        if not self.requests or self.paused:
            return {}, False
        for request_id in list(self.requests):
            self.requests[request_id] -= 1
            if not self.requests[request_id]:
                del self.requests[request_id]
        return {}, True

    def has_work(self) -> bool:
        return bool(self.requests)

    def has_client_work(self) -> bool:
        return bool(self.requests)

    def get_request_counts(self) -> tuple[int, int]:
        return (len(self.requests), 0)

    def is_scheduler_paused(self) -> bool:
        return self.paused


def make_proc(rank: int = 0) -> DPEngineCoreProc:
    proc = object.__new__(DPEngineCoreProc)
    proc.dp_rank, proc.dp_size, proc.lockstep = rank, 2, True
    proc.last_counts = (0, 0)
    proc.current_wave = proc.step_counter = proc.num_dummy_steps = 0
    proc.engines_running = False
    proc.shutdown_state = EngineShutdownState.RUNNING
    proc.engine = FakeEngine()  # type: ignore[assignment]
    proc.dp_group = FakeGroup()  # type: ignore[assignment]
    proc.io = SimpleNamespace(input_queue=queue.Queue(), output_queue=queue.Queue(), send_outputs=lambda o: None)  # type: ignore[assignment]
    proc.settings = SimpleNamespace(shutdown_timeout_s=0.0)  # type: ignore[assignment]
    return proc


def sent(proc: DPEngineCoreProc) -> list[EngineCoreOutputs]:
    items = []
    while not proc.io.output_queue.empty():
        items.append(proc.io.output_queue.get_nowait()[1])
    return items


def add(proc: DPEngineCoreProc, request_id: str, wave: int) -> None:
    proc._add_request(SimpleNamespace(request_id=request_id, dp_wave=wave, client_index=0))  # type: ignore[arg-type]


def iterate(proc: DPEngineCoreProc, times: int = 1) -> None:
    """Runs the lockstep loop's turn (the busy loop less its blocking input wait) ``times`` times."""
    for _ in range(times):
        proc._lockstep_iteration()


def test_a_request_of_the_current_or_a_newer_wave_joins_it_silently():
    proc = make_proc()
    add(proc, "a", 0)
    assert proc.engines_running and proc.current_wave == 0
    add(proc, "b", 5)
    assert proc.current_wave == 5
    iterate(proc)
    assert sent(proc) == []  # the client started the wave and told the others


def test_a_request_from_an_ended_wave_starts_the_current_wave_and_tells_the_client():
    proc = make_proc(rank=1)
    proc.current_wave = 3
    add(proc, "late", 2)
    assert not proc.engines_running
    iterate(proc)
    assert proc.engines_running
    assert [o.start_wave for o in sent(proc)] == [3]


def test_start_dp_wave_rules():
    proc = make_proc(rank=1)
    proc.current_wave = 2
    start = EngineCoreRequestType.START_DP_WAVE
    proc._handle_client_request(start, (1, 0))  # stale
    assert not proc.engines_running
    proc._handle_client_request(start, (2, 1))  # this engine is the one excluded
    assert not proc.engines_running
    proc._handle_client_request(start, (4, 0))
    assert proc.engines_running and proc.current_wave == 4


def test_all_reduce_every_32_steps_dummy_steps_and_wave_completion():
    proc = make_proc(rank=0)
    group: Any = proc.dp_group
    group.peers_unfinished = True  # another engine has work: this one runs dummy steps
    proc._handle_client_request(EngineCoreRequestType.START_DP_WAVE, (0, 1))
    iterate(proc, SYNC_EVERY_STEPS - 1)
    assert group.calls == [] and proc.engines_running
    assert proc.engine.dummy_steps == SYNC_EVERY_STEPS - 1
    iterate(proc)
    assert group.calls == [False] and proc.engines_running
    group.peers_unfinished = False
    iterate(proc, SYNC_EVERY_STEPS)
    assert group.calls == [False, False] and not proc.engines_running
    assert [o.wave_complete for o in sent(proc)] == [0]
    assert (proc.current_wave, proc.step_counter) == (1, 0)
    # Idle and no work: no step, no all-reduce.
    iterate(proc, 100)
    assert len(group.calls) == 2 and proc.engine.dummy_steps == 2 * SYNC_EVERY_STEPS


def test_a_paused_engine_counts_as_idle_but_keeps_stepping_in_a_wave():
    proc = make_proc(rank=1)
    group: Any = proc.dp_group
    add(proc, "kept", 0)
    proc.engine.paused = True
    iterate(proc, SYNC_EVERY_STEPS)
    assert group.calls == [False]  # its kept request does not hold the wave open
    assert not proc.engines_running
    proc.engine.paused = False
    iterate(proc)  # resumed with work while idle: it starts a wave
    assert [o.start_wave for o in sent(proc)] == [1]
