"""Thinking budget: once a request has thought for its budget of tokens, force the end-of-think marker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllite.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates
from vllite.sampling_params import SamplingParams

from .tensors import device_tensor

# A forced token gets this logit (not +inf, which can turn softmax into NaN); the rest of the row is kept.
FORCE_LOGIT = 1e9
BUDGET_KEY = "thinking_token_budget"
START_KEY = "think_start_token_ids"
END_KEY = "think_end_token_ids"
# hf_config attributes searched, in order, for the model's think markers (a list of ids or a single id).
START_ATTRS = ("think_start_token_ids", "reasoning_start_token_ids", "think_start_token_id", "think_start_id")
END_ATTRS = ("think_end_token_ids", "reasoning_end_token_ids", "think_end_token_id", "think_end_id")


def find_last_sequence_index(target: list[int], token_ids: list[int]) -> int:
    """Start of the last occurrence of ``token_ids`` in ``target``; -1 if absent or ``token_ids`` is empty."""
    if not token_ids:
        return -1
    n = len(token_ids)
    for i in range(len(target) - n, -1, -1):
        if target[i : i + n] == token_ids:
            return i
    return -1


def _as_ids(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise ValueError(f"think token ids must be a token id or a list of token ids, got {value!r}.")


def _config_ids(hf_config: Any, attrs: tuple[str, ...]) -> list[int]:
    """The first think-marker attribute set on ``hf_config`` (or on its ``text_config``); ``[]`` if none."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        for attr in attrs:
            ids = _as_ids(getattr(config, attr, None))
            if ids:
                return ids
    return []


def request_budget(params: SamplingParams) -> int | None:
    """A request's thinking budget: ``extra_args["thinking_token_budget"]`` (or a ``thinking_token_budget``
    attribute, as vLLM spells it); ``None`` means the request is not tracked."""
    budget = (params.extra_args or {}).get(BUDGET_KEY)
    return getattr(params, BUDGET_KEY, None) if budget is None else budget


@dataclass
class ThinkState:
    """One request's thinking progress, advanced incrementally over its live output list.

    ``in_think``: inside a think section (after the start marker, before the end marker). ``think_count``:
    thinking tokens of the current section. ``in_end``: the budget is spent and the end marker is being
    forced; ``end_count`` of its tokens are already out. A section that ends naturally or by force resets the
    count, so a later section gets a full budget again.
    """

    start_ids: list[int]
    end_ids: list[int]
    budget: int
    prompt_tail: list[int]
    output: list[int]
    scanned: int = 0
    in_think: bool = False
    think_count: int = 0
    in_end: bool = False
    end_count: int = 0
    _window: list[int] = field(default_factory=list)

    @classmethod
    def from_prompt(
        cls,
        prompt: list[int] | None,
        output: list[int],
        start_ids: list[int],
        end_ids: list[int],
        budget: int,
    ) -> ThinkState:
        prompt = list(prompt or [])
        keep = max(len(start_ids), len(end_ids)) - 1
        state = cls(start_ids, end_ids, budget, prompt[-keep:] if keep else [], output)
        state._window = list(state.prompt_tail)
        last_start = find_last_sequence_index(prompt, start_ids)
        if last_start > find_last_sequence_index(prompt, end_ids):
            state.in_think = True
            state.think_count = len(prompt) - (last_start + len(start_ids))
        state._check_budget()
        state.advance()
        return state

    def _ends_with(self, marker: list[int]) -> bool:
        return len(self._window) >= len(marker) and self._window[len(self._window) - len(marker) :] == marker

    def _check_budget(self) -> None:
        if self.in_think and not self.in_end and self.think_count >= self.budget:
            self.force_end()

    def force_end(self) -> None:
        """Starts forcing the end marker from the next token (the budget is spent, or the section must end)."""
        self.in_end = True
        # An end marker the model already began counts: continue it instead of starting over.
        self.end_count = next((k for k in range(len(self.end_ids) - 1, 0, -1) if self._ends_with(self.end_ids[:k])), 0)

    def advance(self) -> None:
        """Consumes the output tokens appended since the last call."""
        keep = max(len(self.start_ids), len(self.end_ids))
        while self.scanned < len(self.output):
            self._window.append(self.output[self.scanned])
            if len(self._window) > keep:
                del self._window[0]
            self.scanned += 1
            if self.in_end:
                self.end_count += 1
                if self.end_count >= len(self.end_ids):
                    self.in_end = self.in_think = False
                    self.end_count = self.think_count = 0
            elif self.in_think:
                if self._ends_with(self.end_ids):
                    self.in_think = False
                    self.think_count = 0
                else:
                    self.think_count += 1
            elif self._ends_with(self.start_ids):
                self.in_think = True
                self.think_count = 0
            self._check_budget()

    def forced_token(self) -> int | None:
        """The token the next step must emit, or ``None``."""
        return self.end_ids[self.end_count] if self.in_end else None


class ThinkingBudgetLogitsProcessor(LogitsProcessor):
    """Caps the thinking section of reasoning models at a per-request number of tokens.

    A request opts in with ``SamplingParams(extra_args={"thinking_token_budget": N})``. The think markers are
    read from the model's ``hf_config`` (``think_start_token_ids`` / ``think_end_token_ids``, or the
    ``reasoning_*`` / single-id spellings) and may be overridden per request with ``extra_args`` keys
    ``think_start_token_ids`` / ``think_end_token_ids``. A request without an end marker is not tracked.
    Thinking begins after the start marker (in the prompt or the output); once ``N`` thinking tokens exist the
    end marker is forced one token per step (logit set to 1e9, the row is otherwise untouched), after which
    the request may think again with a fresh budget. Not argmax-invariant. Per-step work is proportional to
    the newly generated tokens of tracked requests; device tensors are rebuilt only when the forced rows
    change.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.pin_memory = is_pin_memory
        hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        self.start_ids = _config_ids(hf_config, START_ATTRS)
        self.end_ids = _config_ids(hf_config, END_ATTRS)
        self.states: dict[int, ThinkState] = {}
        self.forced: dict[int, int] = {}  # batch index -> forced token id
        self.logits_slice = (self._device_tensor([], torch.int64), self._device_tensor([], torch.int64))

    def _device_tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return device_tensor(data, dtype, self.device, self.pin_memory)

    def is_argmax_invariant(self) -> bool:
        return False

    def _new_state(self, params: SamplingParams, prompt: list[int] | None, output: list[int]) -> ThinkState | None:
        budget = request_budget(params)
        if budget is None:
            return None
        extra = params.extra_args or {}
        start_ids = _as_ids(extra.get(START_KEY)) or self.start_ids
        end_ids = _as_ids(extra.get(END_KEY)) or self.end_ids
        if not start_ids or not end_ids:
            return None
        return ThinkState.from_prompt(prompt, output, start_ids, end_ids, int(budget))

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(self.states, batch_update, self._new_state)
        forced: dict[int, int] = {}
        for index, state in self.states.items():
            state.advance()
            token = state.forced_token()
            if token is not None:
                forced[index] = token
        if changed or forced != self.forced:
            self.forced = forced
            self.logits_slice = (
                self._device_tensor(list(forced), torch.int64),
                self._device_tensor(list(forced.values()), torch.int64),
            )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.forced:
            logits[self.logits_slice] = FORCE_LOGIT
        return logits

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        budget = request_budget(sampling_params)
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise ValueError(f"{BUDGET_KEY} must be an integer >= 0, got {budget!r}.")
        extra = sampling_params.extra_args or {}
        for key in (START_KEY, END_KEY):
            ids = _as_ids(extra.get(key))
            if ids is not None and (not ids or any(t < 0 for t in ids)):
                raise ValueError(f"{key} must be a non-empty list of token ids >= 0, got {extra.get(key)!r}.")
