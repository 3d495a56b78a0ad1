"""Logits processors for tests: make a real model say exactly what a test needs (a tool call, a stop string)."""

from __future__ import annotations

from typing import Any

import torch

from vllite.logits_processor import AdapterLogitsProcessor
from vllite.sampling_params import SamplingParams

#: ``extra_args`` key (``vllm_xargs`` over HTTP): the token ids the request must emit, in order.
FORCED_TOKENS_KEY = "forced_token_ids"


class ForcedSequenceLogitsProcessor(AdapterLogitsProcessor):
    """A request with ``extra_args["forced_token_ids"] = [t0, t1, ...]`` emits ``t0, t1, ...``: output position
    ``i`` allows only ``t_i`` (end the list with the EOS id to finish with ``"stop"``). Past the list, or without
    the key, logits are untouched. ``validate_params`` rejects a list that is not of token ids at submit time.

    Use: ``--logits-processors vllite.testing.logitsprocs:ForcedSequenceLogitsProcessor``.
    """

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        forced = (sampling_params.extra_args or {}).get(FORCED_TOKENS_KEY)
        if forced is None:
            return
        if not isinstance(forced, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in forced):
            raise ValueError(f"extra_args[{FORCED_TOKENS_KEY!r}] must be a list of token ids, got {forced!r}.")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> Any:
        forced = (params.extra_args or {}).get(FORCED_TOKENS_KEY)
        if not forced:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            position = len(output_ids)
            if position < len(forced):
                target = forced[position]
                logits.fill_(-float("inf"))
                logits[target] = 0.0
            return logits

        return force
