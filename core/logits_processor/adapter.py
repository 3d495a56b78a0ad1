"""``AdapterLogitsProcessor``: runs per-request callables (vLLM V0 style) as one batch processor."""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from vllite.exceptions import LogitsProcessorRowsError, PluginHookError
from vllite.logits_processor.interface import BatchUpdate, LogitsProcessor
from vllite.logits_processor.state import process_dict_updates

if TYPE_CHECKING:
    import torch

    from vllite.sampling_params import SamplingParams

# f(output_ids, logits_row) -> logits_row, or f(prompt_ids, output_ids, logits_row) -> logits_row.
RequestLogitsProcessor = Callable[..., "torch.Tensor"]

_PROMPT_REQUIRED = "Prompt token ids are required for this logits processor but were not provided."


class AdapterLogitsProcessor(LogitsProcessor):
    """Base class that turns a per-request callable into a V1 batch processor.

    A subclass implements :meth:`new_req_logits_processor` (return the request's callable, or ``None`` if the
    request does not use it) and :meth:`is_argmax_invariant`. A callable with two parameters is called as
    ``f(output_ids, logits_row)``, one with three as ``f(prompt_ids, output_ids, logits_row)``; ``output_ids``
    is the request's live output list, so each call sees the tokens generated so far. ``logits_row`` is a
    view of the request's row: edits in place stick; a returned new tensor is written back into the row.
    Rows are processed one by one, which is fine because few requests use such processors.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The callable for a request with these parameters, or ``None`` if the request does not use it."""

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        req_lp = self.new_req_logits_processor(params)
        if req_lp is None:
            return None
        if len(inspect.signature(req_lp).parameters) == 3:
            if prompt_ids is None:
                raise ValueError(_PROMPT_REQUIRED)
            return partial(req_lp, prompt_ids, output_ids)
        return partial(req_lp, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Runs each request's callable on its row. A callable that raises fails its row only: the other rows are
        processed and ``LogitsProcessorRowsError`` reports the failed ones (the engine fails those requests)."""
        failed: dict[int, str] = {}
        for req_idx, req_lp in self.req_info.items():
            row = logits[req_idx]
            try:
                new_row = req_lp(row)
            except Exception as exc:
                failed[req_idx] = str(PluginHookError(self, "apply", exc))
                continue
            if new_row is not row:
                logits[req_idx] = new_row
        if failed:
            raise LogitsProcessorRowsError(failed, logits)
        return logits
