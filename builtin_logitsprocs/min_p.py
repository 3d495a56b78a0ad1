"""Min-p sampling: drop tokens whose probability is below ``min_p`` times the row's top probability."""

from __future__ import annotations

from typing import Any

import torch

from vllite.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllite.sampling_params import SamplingParams

from .tensors import use_pinned_memory


class MinPLogitsProcessor(LogitsProcessor):
    """Masks (to -inf) every token with probability strictly below ``min_p * max_prob`` of its row.

    Reads ``SamplingParams.min_p`` (0 disables it for a request). Argmax-invariant: the most likely token
    always survives. State is one dense float per batch slot, written on the host through a numpy view and
    copied to the device only when a ``BatchUpdate`` changed it; ``min_p_count`` is always the number of
    non-zero slots, and ``apply`` returns its input untouched when it is 0.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        max_num_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.min_p_count = 0
        self.min_p_cpu_tensor = torch.zeros(
            (max_num_reqs,), dtype=torch.float32, device="cpu", pin_memory=use_pinned_memory(is_pin_memory)
        )
        self.min_p_cpu = self.min_p_cpu_tensor.numpy()  # shares memory with min_p_cpu_tensor
        self.use_double_tensor = torch.device(device).type != "cpu"
        if self.use_double_tensor:
            self.min_p_device = torch.empty((max_num_reqs,), dtype=torch.float32, device=device)
        else:
            self.min_p_device = self.min_p_cpu_tensor
        self.min_p: torch.Tensor = self.min_p_device[:0]  # [batch_size, 1] once synced

    def is_argmax_invariant(self) -> bool:
        return True

    def get_min_p_by_index(self, index: int) -> float:
        return float(self.min_p_cpu[index])

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        needs_update = False
        cpu = self.min_p_cpu
        for index, params, _, _ in batch_update.added:
            min_p = params.min_p
            before = cpu[index]
            if before != min_p:
                needs_update = True
                cpu[index] = min_p
                if min_p and not before:
                    self.min_p_count += 1
                elif not min_p and before:
                    self.min_p_count -= 1
        if self.min_p_count:
            if batch_update.removed:
                needs_update = True
                for index in batch_update.removed:
                    if cpu[index]:
                        cpu[index] = 0
                        self.min_p_count -= 1
            for a, b, direct in batch_update.moved:
                min_p_a, min_p_b = cpu[a], cpu[b]
                if min_p_a != min_p_b:
                    needs_update = True
                    cpu[b] = min_p_a
                    if direct == MoveDirectionality.SWAP:
                        cpu[a] = min_p_b
                if direct == MoveDirectionality.UNIDIRECTIONAL:
                    if min_p_a:
                        cpu[a] = 0
                    if min_p_b:
                        self.min_p_count -= 1
        size = batch_update.batch_size
        if self.min_p_count and (needs_update or self.min_p.shape[0] != size):
            self.min_p = self.min_p_device[:size]
            if self.use_double_tensor:
                self.min_p.copy_(self.min_p_cpu_tensor[:size], non_blocking=True)
            self.min_p.unsqueeze_(1)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.min_p_count:
            return logits
        probs = torch.softmax(logits, dim=-1)
        threshold = torch.amax(probs, dim=-1, keepdim=True).mul_(self.min_p)
        logits.masked_fill_(probs < threshold, -float("inf"))
        return logits

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        min_p = sampling_params.min_p
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}.")
