"""Logit bias: add a per-request ``{token_id: bias}`` to the logits."""

from __future__ import annotations

from typing import Any

import torch

from vllite.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates
from vllite.sampling_params import SamplingParams

from .tensors import device_tensor


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds ``SamplingParams.logit_bias[token]`` to ``logits[row, token]`` for every request that sets it.

    Not argmax-invariant. State is sparse (``biases``: batch index -> bias dict); the flattened index and
    value tensors on the device are rebuilt only when a ``BatchUpdate`` changed that state, and ``apply`` is a
    single scatter-add (no row loop).
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.pin_memory = is_pin_memory
        self.biases: dict[int, dict[int, float]] = {}
        self.bias_tensor: torch.Tensor = self._device_tensor([], torch.float32)
        self.logits_slice = (self._device_tensor([], torch.int32), self._device_tensor([], torch.int32))

    def _device_tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return device_tensor(data, dtype, self.device, self.pin_memory)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not process_dict_updates(self.biases, batch_update, lambda params, _, __: params.logit_bias or None):
            return
        reqs: list[int] = []
        tok_ids: list[int] = []
        values: list[float] = []
        for req, bias in self.biases.items():
            reqs.extend([req] * len(bias))
            tok_ids.extend(bias.keys())
            values.extend(bias.values())
        self.bias_tensor = self._device_tensor(values, torch.float32)
        self.logits_slice = (
            self._device_tensor(reqs, torch.int32),
            self._device_tensor(tok_ids, torch.int32),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.biases:
            logits[self.logits_slice] += self.bias_tensor
        return logits

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        for token_id in sampling_params.logit_bias or {}:
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id!r}.")
