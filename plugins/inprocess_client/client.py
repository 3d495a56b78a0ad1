"""``InprocClient``: the engine core in the caller's thread, behind the ``EngineCoreClient`` interface."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

from vllite.config import EngineConfig
from vllite.engine.core_client import UTILITY_METHODS, EngineCoreClient, sigint_deferred
from vllite.protocol import EngineCoreOutputs, EngineCoreRequest


class InprocClient(EngineCoreClient):
    """Runs the engine core in the caller's thread: ``get_output()`` is one engine step.

    A utility call that must wait for the engine (pause ``wait``, sleep) steps it until done, keeping the
    outputs those steps produce for the following ``get_output()`` calls, so nothing is lost or reordered.
    """

    def __init__(self, config: EngineConfig, *, log_stats: bool | None = None) -> None:
        from vllite.engine.core import EngineCore

        self.engine_core = EngineCore(config, log_stats=log_stats)
        govern = getattr(self.engine_core.model_executor, "govern_inprocess_steps", None)
        if govern is not None:  # the engine steps in this thread: its executor may place the model's threads
            try:
                govern(self.engine_core)
            except BaseException:
                self.engine_core.shutdown()
                raise
        self.engine_info = self.engine_core.info
        self._stepped_outputs: deque[EngineCoreOutputs] = deque()
        self._closed = False

    def add_request(self, request: EngineCoreRequest) -> None:
        sigint_deferred(self.engine_core.add_request, request)

    def get_output(self) -> EngineCoreOutputs:
        if self._stepped_outputs:
            return self._stepped_outputs.popleft()
        return self._step()

    def _step(self) -> EngineCoreOutputs:
        outputs, _ = sigint_deferred(self.engine_core.step_fn)  # a Ctrl-C lets the step end: no half-done state
        return (outputs or {}).get(0) or EngineCoreOutputs()

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        if method not in UTILITY_METHODS:
            raise ValueError(
                f"Unknown or disallowed engine utility {method!r}; allowed: {', '.join(sorted(UTILITY_METHODS))}."
            )
        result = getattr(self.engine_core, method)(*args)
        if isinstance(result, Future):
            while not result.done():
                outputs = self._step()
                if outputs.outputs or outputs.finished_requests:
                    self._stepped_outputs.append(outputs)
            return result.result()
        return result

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine_core.shutdown()
