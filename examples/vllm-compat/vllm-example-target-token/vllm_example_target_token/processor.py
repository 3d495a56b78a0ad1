"""``DummyLogitsProcessor``: a batch-level processor that leaves only ``extra_args["target_token"]`` sampleable.

Re-written from vLLM's "Custom Logits Processors" documentation. The per-request state is a sparse
``batch index -> target token`` dict, kept in step with the persistent batch by hand (removed → added →
moved), comparing each move against ``vllm``'s ``MoveDirectionality`` as the documentation does.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

TARGET_TOKEN_ARG = "target_token"


def _target_token(params: SamplingParams) -> int | None:
    """The request's target token, or ``None`` when it did not ask for one."""
    return (params.extra_args or {}).get(TARGET_TOKEN_ARG)


class DummyLogitsProcessor(LogitsProcessor):
    """Masks every token but ``target_token`` (keeping its logit) in the rows of requests that set it.

    Requests without the argument are untouched. It changes the greedy choice, so it is not
    argmax-invariant.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, int] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Rejects a ``target_token`` that is not a token id when the request is submitted."""
        target = _target_token(sampling_params)
        if target is not None and (not isinstance(target, int) or isinstance(target, bool) or target < 0):
            raise VLLMValidationError(
                f"{TARGET_TOKEN_ARG} must be a non-negative integer token id, got {target!r}",
                parameter=TARGET_TOKEN_ARG,
                value=target,
            )

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self.req_info.pop(index, None)
        for index, params, _prompt_ids, _output_ids in batch_update.added:
            target = _target_token(params)
            if target is None:
                self.req_info.pop(index, None)  # the slot's previous request may have had one
            else:
                self.req_info[index] = target
        for a_index, b_index, direction in batch_update.moved:
            a_target = self.req_info.pop(a_index, None)
            b_target = self.req_info.pop(b_index, None)
            if direction == MoveDirectionality.UNIDIRECTIONAL:
                if a_target is not None:
                    self.req_info[b_index] = a_target
            elif direction == MoveDirectionality.SWAP:
                if a_target is not None:
                    self.req_info[b_index] = a_target
                if b_target is not None:
                    self.req_info[a_index] = b_target
            else:
                # An enum the processor does not recognise means its state would drift: say so at once.
                raise ValueError(f"unknown move direction {direction!r}")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info), dtype=torch.long, device=logits.device)
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        kept = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = kept
        return logits
