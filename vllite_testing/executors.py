"""A model-free :class:`~vllite.executor.Executor` for testing the engine (in-process and in the engine process):
select it with ``executor="vllite.testing.executors:PositionTokenExecutor"`` (or
``executor=PositionTokenExecutor`` in-process).

It samples token ``token_base + position`` (default ``1000 + position``, so every request's expected output is
known in advance), sizes the KV cache from ``num_gpu_blocks_override`` (default 256 blocks) and reads
``config.plugin_config["fake_executor"]``: ``step_delay_s`` (simulated forward time per step), ``fail_at_step``
(raise :class:`~vllite.exceptions.ModelExecutionError` from that step on), ``report_failure_at_step`` (call the
failure callbacks from that step on, as a dead worker would), ``init_delay_s`` (slow start-up), ``token_base``
(first token id, default 1000).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from vllite.exceptions import ModelExecutionError
from vllite.executor import Executor, KVCacheInfo, ModelInfo
from vllite.sched.output import ModelRunnerOutput, SchedulerOutput
from vllite.testing.scheduler import ScriptedModelRunner


class PositionTokenExecutor(Executor):
    """A real ``Executor`` without a model: each sampled token is ``token_base + position`` (see the module
    docstring for the fault-injection and timing options)."""

    def _init_executor(self) -> ModelInfo:
        options: dict[str, Any] = dict(self.config.plugin_config.get("fake_executor") or {})
        self.step_delay_s = float(options.get("step_delay_s", 0.0))
        self.fail_at_step = options.get("fail_at_step")
        self.report_failure_at_step = options.get("report_failure_at_step")
        base = int(options.get("token_base", 1000))
        if options.get("init_delay_s"):
            threading.Event().wait(float(options["init_delay_s"]))  # simulated model loading
        self.steps = 0
        self._runner = ScriptedModelRunner(lambda _req_id, position: base + position)
        return ModelInfo(max_model_len=self.config.model_config.max_model_len or 512, vocab_size=base + 100_000)

    def initialize_kv_cache(self) -> KVCacheInfo:
        num_blocks = self.config.cache_config.num_gpu_blocks_override or 256
        return KVCacheInfo(num_blocks=num_blocks, max_model_len=self.model_info.max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= int(self.fail_at_step):
            raise ModelExecutionError(f"{type(self).__name__}: injected failure at step {self.steps}")
        if self.report_failure_at_step is not None and self.steps >= int(self.report_failure_at_step):
            self._report_failure()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)  # simulated forward pass
        return self._runner.execute(scheduler_output)

    def shutdown(self) -> None:
        self._runner.num_tokens.clear()
