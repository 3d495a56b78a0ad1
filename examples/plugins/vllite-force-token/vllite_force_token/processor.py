"""``ForceTokenLogitsProcessor``: rows of requests with ``extra_args["force_token_id"]`` allow only that token."""

from __future__ import annotations

from typing import Any

import torch

from vllite.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates
from vllite.sampling_params import SamplingParams

FORCE_TOKEN_KEY = "force_token_id"


def _target(params: SamplingParams) -> int | None:
    return (params.extra_args or {}).get(FORCE_TOKEN_KEY)


class ForceTokenLogitsProcessor(LogitsProcessor):
    """Makes a request emit only ``extra_args["force_token_id"]``: its row becomes -inf except that token (0).

    Requests without the key are untouched. Not argmax-invariant (it changes the greedy choice). State is a
    sparse ``batch index -> token`` dict kept in step with the batch by ``process_dict_updates``; the index
    tensors on the device are rebuilt only when it changes. ``validate_params`` rejects a target that is not
    a token id at submit time.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.targets: dict[int, int] = {}
        self.rows = torch.empty(0, dtype=torch.long, device=self.device)
        self.tokens = torch.empty(0, dtype=torch.long, device=self.device)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = _target(sampling_params)
        if target is not None and (not isinstance(target, int) or isinstance(target, bool) or target < 0):
            raise ValueError(f"extra_args[{FORCE_TOKEN_KEY!r}] must be a token id (integer >= 0), got {target!r}.")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.targets, batch_update, lambda params, _prompt, _out: _target(params)):
            self.rows = torch.tensor(list(self.targets), dtype=torch.long).to(self.device)
            self.tokens = torch.tensor(list(self.targets.values()), dtype=torch.long).to(self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.targets:
            return logits
        logits[self.rows] = -float("inf")
        logits[self.rows, self.tokens] = 0.0
        return logits
