"""``DPEngineCoreProc``: the engine-core process of one data-parallel rank.

Every DP engine publishes its load: when its ``(running, waiting)`` counts change, its next outputs carry them as
``SchedulerStats`` (an otherwise empty batch when nothing else is sent), which the client's router reads (vLLM's
``_maybe_publish_request_counts``). Without ``dp_lockstep`` that is the only difference: the engines step
independently.

With ``dp_lockstep`` (standing in for MoE expert parallelism, where every rank must join every forward) the
engines step in **waves**, as vLLM's ``DPEngineCoreProc`` does:

* while any engine has work, every engine steps: one with nothing to run executes a dummy (empty) batch;
* every ``SYNC_EVERY_STEPS`` steps the engines all-reduce "any unfinished requests?" (``dp_group.DPGroup``); when
  none has any, the wave ends: rank 0 reports ``wave_complete``, every engine moves to the next wave and idles;
* the client stamps each request with the wave it believes current and, when it starts a wave, sends
  ``START_DP_WAVE`` to the other engines. A request stamped with a wave that has already ended (it crossed the
  wave's end in flight) reaches an idle engine: that engine starts the current wave itself and tells the client
  (``start_wave``), which wakes the others, so no request is stranded. An engine that finds schedulable work
  while idle otherwise (after a resume) does the same;
* a paused engine counts as having no work (its kept requests wait for the resume) but keeps stepping while a wave
  runs; pause and resume reach every engine (the client fans them out), so they pause and resume together.
"""

from __future__ import annotations

import time
from typing import Any

from vllite.protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, SchedulerStats
from vllite.request import Request
from vllite.sched.output import SchedulerOutput

from .core_proc import EngineCoreProc
from .dp_group import GROUP_ADDRESS_KEY, DPGroup
from .utils import PLUGIN_KEY

#: Steps between two "any unfinished?" all-reduces (vLLM's cadence).
SYNC_EVERY_STEPS = 32


class DPEngineCoreProc(EngineCoreProc):
    """An engine core that is one rank of a data-parallel group (see the module docstring)."""

    def __init__(self, config: Any, handshake_address: str, **kwargs: Any) -> None:
        parallel = config.parallel_config
        self.dp_rank: int = parallel.data_parallel_rank
        self.dp_size: int = parallel.data_parallel_size
        self.lockstep: bool = parallel.dp_lockstep
        self.last_counts: tuple[int, int] = (0, 0)
        self.current_wave = 0
        self.step_counter = 0
        self.num_dummy_steps = 0
        self.dp_group: DPGroup | None = None
        super().__init__(config, handshake_address, **kwargs)
        if self.lockstep:
            address = str((config.plugin_config.get(PLUGIN_KEY) or {}).get(GROUP_ADDRESS_KEY))
            self.dp_group = DPGroup(address, self.dp_rank, self.dp_size)

    # ------------------------------------------------------------------ requests
    def _preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        prepared = super()._preprocess_add_request(request)
        prepared.dp_wave = request.current_wave  # type: ignore[attr-defined]
        return prepared

    def _add_request(self, request: Request) -> None:
        super()._add_request(request)
        if not self.lockstep:
            return
        wave = getattr(request, "dp_wave", 0)
        if wave >= self.current_wave:
            # The client started (or joined) this wave and told the other engines.
            self.current_wave = wave
            self.engines_running = True
        # An older wave: this request crossed the wave's end; the idle check in the busy loop restarts it.

    def _handle_client_request(self, request_type: EngineCoreRequestType, request: Any) -> None:
        if request_type == EngineCoreRequestType.START_DP_WAVE:
            new_wave, exclude_engine = request
            if self.lockstep and exclude_engine != self.dp_rank and new_wave >= self.current_wave:
                self.current_wave = new_wave
                self.engines_running = True
            return
        super()._handle_client_request(request_type, request)

    # ------------------------------------------------------------------ stepping
    def _step_and_publish(self) -> bool:
        """One engine step; its outputs (with the load counts when they changed) go to the client."""
        outputs, model_executed = self.engine.step_fn()
        counts = tuple(self.engine.get_request_counts())
        if counts != self.last_counts:
            self.last_counts = (counts[0], counts[1])
            outputs = outputs or {}
            batch = outputs.setdefault(0, EngineCoreOutputs())
            if batch.scheduler_stats is None:
                batch.scheduler_stats = SchedulerStats(num_running_reqs=counts[0], num_waiting_reqs=counts[1])
        if outputs:
            self.io.send_outputs(outputs)
        return model_executed

    def _process_engine_step(self) -> None:
        if not self._step_and_publish() and self.engine.scheduler.has_unfinished_requests():
            time.sleep(0.001)  # nothing could run yet: yield the GIL to the I/O threads

    def _has_local_work(self) -> bool:
        """Unfinished requests this engine may schedule (a paused engine's wait for the resume)."""
        return self.engine.scheduler.has_unfinished_requests() and not self.engine.is_scheduler_paused()

    def run_busy_loop(self) -> None:
        """Independent steps, or (``dp_lockstep``) waves: see the module docstring."""
        if not self.lockstep:
            super().run_busy_loop()
            return
        while self._handle_shutdown():
            self._process_input_queue()
            self._lockstep_iteration()
        raise SystemExit

    def _lockstep_iteration(self) -> None:
        """One turn of the lockstep loop once the input is taken: a real or dummy step while a wave runs, the
        all-reduce every ``SYNC_EVERY_STEPS`` steps, and the wave's end."""
        local_work = self._has_local_work()
        if not self.engines_running and local_work:
            self._start_wave()
        executed = self._step_and_publish()
        local_work = self._has_local_work()
        if not executed:
            if not local_work and not self.engines_running:
                if self.engine.scheduler.has_unfinished_requests():
                    time.sleep(0.001)  # paused with kept requests: wait for input without spinning hot
                return
            self._execute_dummy_batch()
        self.engines_running = self._has_global_unfinished_reqs(local_work)
        if not self.engines_running:
            if self.dp_rank == 0:
                self._send_to_client(EngineCoreOutputs(wave_complete=self.current_wave))
            self.current_wave += 1
            self.step_counter = 0

    def _start_wave(self) -> None:
        """Work found while idle (a request from an ended wave, or a resume): run, and have the client wake the
        other engines."""
        self.engines_running = True
        self._send_to_client(EngineCoreOutputs(start_wave=self.current_wave))

    def _execute_dummy_batch(self) -> None:
        """An empty forward so the busy engines' collectives find this rank (no batch of its own in flight)."""
        self.num_dummy_steps += 1
        if not self.engine.batch_queue:
            self.engine.model_executor.execute_model(SchedulerOutput.make_empty())

    def _has_global_unfinished_reqs(self, local_work: bool) -> bool:
        self.step_counter += 1
        if self.step_counter % SYNC_EVERY_STEPS != 0:
            return True  # assume the wave goes on: no all-reduce on every step
        assert self.dp_group is not None
        return self.dp_group.any_unfinished(local_work)

    def _send_to_client(self, outputs: EngineCoreOutputs) -> None:
        self.io.output_queue.put_nowait((0, outputs))
