"""``LoRABatch``: the current step's adapter slot per token, shared by every LoRA layer of a model.

The manager publishes it once per step (:meth:`LoRABatch.set_token_slots`); each wrapped layer reads it in its
forward. It also holds what the step's batched ops need, built once here rather than once per layer: the
token-by-slot mask of the CPU path, or the tokens grouped by slot for the Triton kernels on CUDA.
"""

from __future__ import annotations

import torch

from vllite.exceptions import BatchStateError
from vllite.plugins.transformers_executor.lora.punica import SlotSegments, slot_mask


def triton_selected(device: torch.device) -> bool:
    """Whether LoRA layers on ``device`` run the Triton kernels: CUDA with triton available (and not disabled by
    ``VLLITE_DISABLE_TRITON``, as for vllite's attention kernels)."""
    if device.type != "cuda":
        return False
    from vllite.kernels import is_triton_available

    return is_triton_available()


class LoRABatch:
    """The step's ``token_slots`` ``[T]`` (int64 on the device: a slot in ``0 .. num_slots - 1``, or -1 for the
    base model), or none at all when no token of the step uses an adapter — then every layer runs its base module
    alone, at no cost. ``use_triton`` picks the kernels (default: :func:`triton_selected`)."""

    def __init__(
        self, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype, use_triton: bool | None = None
    ) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.use_triton = triton_selected(device) if use_triton is None else use_triton
        self.token_slots: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._segments: SlotSegments | None = None

    @property
    def active(self) -> bool:
        """Whether some token of the step uses an adapter (else the layers skip the delta entirely)."""
        return self.token_slots is not None

    @property
    def num_tokens(self) -> int:
        """The step's token count (0 when inactive)."""
        return 0 if self.token_slots is None else int(self.token_slots.shape[0])

    def set_token_slots(self, token_slots: torch.Tensor) -> None:
        """Publishes the step's slots (``[T]`` int64 on ``device``; at least one ≥ 0) and prepares the path's
        per-step tensors."""
        self.token_slots = token_slots
        if self.use_triton:
            self._segments = SlotSegments.from_token_slots(token_slots, self.num_slots)
            self._mask = None
        else:
            self._mask = slot_mask(token_slots, self.num_slots, self.max_rank, self.dtype)
            self._segments = None

    def clear(self) -> None:
        """No token of the next step uses an adapter."""
        self.token_slots = self._mask = self._segments = None

    def mask(self) -> torch.Tensor:
        """The CPU path's ``[T, num_slots * max_rank]`` token-by-slot mask (see :func:`~.punica.slot_mask`)."""
        if self._mask is None:
            raise BatchStateError("LoRABatch.mask() read while no masked LoRA step is published")
        return self._mask

    def segments(self) -> SlotSegments:
        """The Triton path's tokens grouped by slot."""
        if self._segments is None:
            raise BatchStateError("LoRABatch.segments() read while no Triton LoRA step is published")
        return self._segments

    def check_tokens(self, num_tokens: int, layer: str) -> None:
        """Raises :class:`BatchStateError` when ``layer`` sees ``num_tokens`` tokens but the step has another count
        (the model ran on inputs other than those :meth:`set_token_slots` described)."""
        if num_tokens != self.num_tokens:
            raise BatchStateError(
                f"LoRA layer {layer} got {num_tokens} tokens but the step's adapter slots cover {self.num_tokens}: "
                "prepare the LoRA step for exactly the tokens of the forward pass"
            )
