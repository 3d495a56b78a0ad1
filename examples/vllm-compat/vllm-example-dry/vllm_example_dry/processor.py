"""``DRYLogitsProcessor``: the DRY ("Don't Repeat Yourself") repetition penalty on vLLM's slot interface.

DRY penalises the tokens that would extend a repetition of the text so far. Let the context end with the
token ``t``. For every earlier occurrence of ``t`` the processor measures how many tokens before it match
the tokens before the end of the context (the match length ``n``, counting ``t`` itself); the token that
followed that occurrence would repeat the sequence once more. If ``n >= allowed_length``, that token's
logit is lowered by ``multiplier * base ** (n - allowed_length)`` (the longest match per token counts).
So with a large multiplier no sequence longer than ``allowed_length`` tokens is repeated.

Per-request settings come from ``SamplingParams.extra_args``: ``dry_multiplier`` (> 0 enables it),
``dry_base`` (default 1.75), ``dry_allowed_length`` (default 2) and ``dry_range`` (how many trailing tokens
of the context to search; 0, the default, searches all of it). Sequence breakers are not implemented.

The processor follows vLLM's slot-interface documentation: settings are keyed by request slot and fully
rewritten in ``add_request`` (slots are recycled and there is no removal hook), host-side writes are staged
and flushed in ``apply_staged_writes``, and ``apply`` finds each logits row's slot through
``ctx.expanded_idx_mapping`` and reads the request's committed tokens from ``req_states``.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor, LogitsProcRequestState

MULTIPLIER_ARG = "dry_multiplier"
BASE_ARG = "dry_base"
ALLOWED_LENGTH_ARG = "dry_allowed_length"
RANGE_ARG = "dry_range"
DEFAULT_BASE = 1.75
DEFAULT_ALLOWED_LENGTH = 2
# The penalty stops growing this many tokens past the allowed length (keeps ``base ** n`` finite).
MAX_EXPONENT = 32


def dry_penalties(history: Sequence[int], multiplier: float, base: float, allowed_length: int) -> dict[int, float]:
    """``token -> penalty`` for the token that follows ``history`` (empty when nothing repeats enough)."""
    end = len(history) - 1
    if end < 1:
        return {}
    longest: dict[int, int] = {}
    for i in range(end):
        if history[i] != history[end]:
            continue
        length = 1  # history[i - length + 1 : i + 1] == history[end - length + 1 : end + 1]
        while length <= i and history[i - length] == history[end - length]:
            length += 1
        follower = history[i + 1]
        longest[follower] = max(longest.get(follower, 0), length)
    return {
        token: multiplier * base ** min(length - allowed_length, MAX_EXPONENT)
        for token, length in longest.items()
        if length >= allowed_length
    }


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class DRYLogitsProcessor(LogitsProcessor):
    """DRY repetition penalty for the requests that set ``extra_args["dry_multiplier"] > 0``."""

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        super().__init__(vllm_config, req_states)
        self.req_states = req_states
        num_slots = req_states.max_num_reqs
        # Host-side per-slot settings, written by add_request(); a multiplier of 0 disables the slot.
        self.multiplier = torch.zeros(num_slots, dtype=torch.float32)
        self.base = np.full(num_slots, DEFAULT_BASE, dtype=np.float64)
        self.allowed_length = np.full(num_slots, DEFAULT_ALLOWED_LENGTH, dtype=np.int64)
        self.search_range = np.zeros(num_slots, dtype=np.int64)
        # The device copy that apply() reads, refreshed once per step by apply_staged_writes().
        self.multiplier_dev = torch.zeros(num_slots, dtype=torch.float32, device=req_states.device)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Rejects malformed DRY settings when the request is submitted."""
        args = sampling_params.extra_args or {}
        checks = {
            MULTIPLIER_ARG: (_is_number, lambda v: v >= 0, "a number >= 0"),
            BASE_ARG: (_is_number, lambda v: v > 1, "a number > 1"),
            ALLOWED_LENGTH_ARG: (_is_int, lambda v: v >= 1, "an integer >= 1"),
            RANGE_ARG: (_is_int, lambda v: v >= 0, "an integer >= 0"),
        }
        for name, (type_ok, value_ok, expected) in checks.items():
            if name in args and not (type_ok(args[name]) and value_ok(args[name])):
                raise ValueError(f"{name} must be {expected}, got {args[name]!r}")

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        args = sampling_params.extra_args or {}
        multiplier = float(args.get(MULTIPLIER_ARG, 0.0))
        self.multiplier[req_idx] = multiplier
        self.base[req_idx] = float(args.get(BASE_ARG, DEFAULT_BASE))
        self.allowed_length[req_idx] = int(args.get(ALLOWED_LENGTH_ARG, DEFAULT_ALLOWED_LENGTH))
        self.search_range[req_idx] = int(args.get(RANGE_ARG, 0))
        return multiplier > 0

    def apply_staged_writes(self) -> None:
        self.multiplier_dev.copy_(self.multiplier, non_blocking=True)

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        row_slots = ctx.expanded_idx_mapping.long()
        rows = torch.nonzero(self.multiplier_dev[row_slots] > 0).squeeze(1)
        if rows.numel() == 0:
            return logits
        slots = row_slots[rows]
        lengths = self.req_states.total_len.gpu[slots].tolist()
        for row, slot, length in zip(rows.tolist(), slots.tolist(), lengths):
            start = max(0, length - int(self.search_range[slot])) if self.search_range[slot] else 0
            history = self.req_states.all_token_ids.gpu[slot, start:length].tolist()
            penalties = dry_penalties(
                history, float(self.multiplier[slot]), float(self.base[slot]), int(self.allowed_length[slot])
            )
            if penalties:
                tokens = torch.tensor(list(penalties), dtype=torch.long, device=logits.device)
                values = torch.tensor(list(penalties.values()), dtype=logits.dtype, device=logits.device)
                logits[row, tokens] -= values
        return logits
