"""Repetition detection in the reasoning section: on a loop there, force the end-of-reasoning marker.

``SamplingParams.repetition_detection`` (vLLM's field, :mod:`vllite.repetition`) ends the whole request in the
scheduler's stop check. With ``extra_args={"repetition_detection_scope": "reasoning"}`` it watches only the
reasoning section instead, here: the request keeps its answer, as with an exhausted thinking budget.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from vllite.exceptions import LogitsProcessorRowsError
from vllite.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates
from vllite.repetition import SCOPE_KEY, SCOPES, RepetitionDetectionParams, check_sequence_repetition, ends_request
from vllite.sampling_params import SamplingParams

from .tensors import device_tensor
from .thinking_budget import END_ATTRS, END_KEY, FORCE_LOGIT, START_ATTRS, START_KEY, ThinkState, _as_ids, _config_ids

NO_MARKERS = (
    f"{SCOPE_KEY}='reasoning' needs the reasoning markers: the model's config names none, so pass extra_args "
    f"{START_KEY!r} and {END_KEY!r} (token ids), or use the default scope 'request'."
)


@dataclass
class _Watch:
    """One request's reasoning section (``None``: no markers known, the request fails) and its detection."""

    think: ThinkState | None
    params: RepetitionDetectionParams

    def loops(self) -> bool:
        """Whether the current reasoning section ends in a repeated pattern (only its tokens are looked at)."""
        think = self.think
        assert think is not None
        params = self.params
        window = min(think.think_count, len(think.output), params.max_pattern_size * params.min_count)
        return window > 0 and check_sequence_repetition(think.output[-window:], params)


class RepetitionDetectionLogitsProcessor(LogitsProcessor):
    """Ends a request's reasoning section, not the request, when it starts repeating itself.

    A request opts in with ``repetition_detection`` and ``extra_args={"repetition_detection_scope":
    "reasoning"}``. The reasoning markers are found as the thinking budget finds them: the model's ``hf_config``
    (``think_start_token_ids`` / ``think_end_token_ids`` or their ``reasoning_*`` / single-id spellings), or the
    request's ``extra_args`` of the same names. While inside a section, once its tokens end in
    ``min_count`` copies of a pattern of ``min_pattern_size``..``max_pattern_size`` tokens, the end marker is forced
    one token per step (logit 1e9); the model then answers, and a later section is watched afresh. A request in
    that scope with no markers fails with an error naming them. Per-step work: at most ``max_pattern_size *
    min_count`` tokens per watched request.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.pin_memory = is_pin_memory
        hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        self.start_ids = _config_ids(hf_config, START_ATTRS)
        self.end_ids = _config_ids(hf_config, END_ATTRS)
        self.watches: dict[int, _Watch] = {}
        self.forced: dict[int, int] = {}  # batch index -> forced token id
        self.unmarked: list[int] = []  # batch indices of watched requests without markers
        self.logits_slice = (self._device_tensor([]), self._device_tensor([]))

    def _device_tensor(self, data: list[int]) -> torch.Tensor:
        return device_tensor(data, torch.int64, self.device, self.pin_memory)

    def is_argmax_invariant(self) -> bool:
        return False

    def _new_watch(self, params: SamplingParams, prompt: list[int] | None, output: list[int]) -> _Watch | None:
        detection = params.repetition_detection
        if detection is None or not detection.enabled or ends_request(params):
            return None
        extra = params.extra_args or {}
        start_ids = _as_ids(extra.get(START_KEY)) or self.start_ids
        end_ids = _as_ids(extra.get(END_KEY)) or self.end_ids
        if not start_ids or not end_ids:
            return _Watch(None, detection)
        return _Watch(ThinkState.from_prompt(prompt, output, start_ids, end_ids, sys.maxsize), detection)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(self.watches, batch_update, self._new_watch)
        forced: dict[int, int] = {}
        self.unmarked = []
        for index, watch in self.watches.items():
            think = watch.think
            if think is None:
                self.unmarked.append(index)
                continue
            think.advance()
            if think.in_think and not think.in_end and watch.loops():
                think.force_end()
            token = think.forced_token()
            if token is not None:
                forced[index] = token
        if changed or forced != self.forced:
            self.forced = forced
            self.logits_slice = (self._device_tensor(list(forced)), self._device_tensor(list(forced.values())))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.forced:
            logits[self.logits_slice] = FORCE_LOGIT
        if self.unmarked:
            raise LogitsProcessorRowsError({row: NO_MARKERS for row in self.unmarked}, logits)
        return logits

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = sampling_params.extra_args or {}
        scope = extra.get(SCOPE_KEY)
        if scope is None:
            return
        if scope not in SCOPES:
            raise ValueError(f"extra_args[{SCOPE_KEY!r}] must be one of {', '.join(SCOPES)}, got {scope!r}.")
        detection = sampling_params.repetition_detection
        if detection is None or not detection.enabled:
            raise ValueError(
                f"extra_args[{SCOPE_KEY!r}] needs repetition_detection with max_pattern_size > 0 (it says what a "
                "detected repetition ends)."
            )
