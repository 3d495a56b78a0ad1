"""The LoRA layers that replace a model's target modules in place: ``base(x) + delta`` for every adapter at once.

Each layer keeps its base module (``base_layer``) and, per device slot, the slot's adapter matrices zero-padded
to the maximum rank (the adapter's scaling folded into B), and reads the step's slot per token from the shared
:class:`~.batch.LoRABatch`. The delta of all tokens is one batched computation (:mod:`.punica`; the Triton
kernels of :mod:`.punica_triton` on CUDA), never a loop over adapters; a step in which no token uses an adapter
runs the base module alone. Storage (contiguous, chosen so the CPU path's GEMMs read plain views):

- ``lora_a``: ``[L, R, in]`` for a linear layer, ``[vocab, L, R]`` for an embedding (rows gathered by token id);
- ``lora_b``: ``[out, L, R]``, so ``B_all`` ``[out, L*R]`` is a view.

``a_stack`` (``[L, R, in]``) and ``b_stack`` (``[L, out, R]``) are the logical views the per-token ops take.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch
from torch import nn

from vllite.plugins.transformers_executor.lora.adapter import LoRAWeights
from vllite.plugins.transformers_executor.lora.batch import LoRABatch
from vllite.plugins.transformers_executor.lora.punica import (
    embedding_shrink,
    expand_masked_,
    shrink_embedding_masked,
    shrink_masked,
)
from vllite.plugins.transformers_executor.lora.targets import ModelTargets


@functools.cache
def _triton_ops() -> ModuleType:
    from vllite.plugins.transformers_executor.lora import punica_triton

    return punica_triton


class LoRALayer(nn.Module):
    """What both layers share: the base module, the B stack, slot writes and the shape attributes."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(self, base: nn.Module, name: str, in_features: int, out_features: int, batch: LoRABatch) -> None:
        super().__init__()
        self.base_layer = base
        self.layer_name = name
        self.in_features = in_features
        self.out_features = out_features
        self.batch = batch
        shape = (out_features, batch.num_slots, batch.max_rank)
        self.register_buffer("lora_b", torch.zeros(shape, device=batch.device, dtype=batch.dtype), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The base module's weight (for code that reads ``module.weight``)."""
        weight = self.base_layer.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    @property
    def b_stack(self) -> torch.Tensor:
        """``[L, out, R]`` view of the slots' B matrices (scaled)."""
        return self.lora_b.permute(1, 0, 2)

    @property
    def b_all(self) -> torch.Tensor:
        """``[out, L*R]``: every slot's B side by side."""
        return self.lora_b.view(self.out_features, -1)

    def _a_slot(self, slot: int) -> torch.Tensor:
        """The ``[R, in]`` view of ``slot``'s A matrix."""
        raise NotImplementedError

    @torch.inference_mode()
    def set_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        """Writes ``weights`` (rank ≤ R, shapes checked by the loader) into ``slot``, zero-padded, with the scaling
        folded into B (computed in float32); ``None`` zeroes the slot (an adapter that leaves this module alone)."""
        a_view = self._a_slot(slot)
        b_view = self.lora_b[:, slot, :]
        a_view.zero_()
        b_view.zero_()
        if weights is None:
            return
        rank = weights.rank
        a_view[:rank].copy_(weights.a)
        b_view[:, :rank].copy_(weights.b.to(torch.float32) * weights.scaling)

    def _add_delta(self, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Adds the delta expanded from the step's shrink ``h`` to ``y`` in place (made contiguous first) and
        returns ``y``: ``h`` is the masked ``[T, L*R]`` of the CPU path or the per-token ``[T, R]`` of Triton's."""
        y = y if y.is_contiguous() else y.contiguous()
        y2 = y.view(-1, self.out_features)
        if self.batch.use_triton:
            _triton_ops().lora_expand_triton(y2, h, self.b_stack, self.batch.segments())
        else:
            expand_masked_(y2, h, self.b_all)
        return y


class LoRALinear(LoRALayer):
    """Wraps a linear-like module (``nn.Linear`` or a packed quantized linear: any leaf with ``forward(x)`` from
    ``[..., in]`` to ``[..., out]``); ``forward(x) = base(x) + B[slot_t] @ A[slot_t] @ x_t`` per token ``t``."""

    def __init__(self, base: nn.Module, name: str, batch: LoRABatch) -> None:
        in_features: Any = base.in_features  # a plain int on any linear-like module
        out_features: Any = base.out_features
        super().__init__(base, name, int(in_features), int(out_features), batch)
        shape = (batch.num_slots, batch.max_rank, self.in_features)
        self.register_buffer("lora_a", torch.zeros(shape, device=batch.device, dtype=batch.dtype), persistent=False)

    @property
    def a_stack(self) -> torch.Tensor:
        """``[L, R, in]``: the slots' A matrices."""
        return self.lora_a

    def _a_slot(self, slot: int) -> torch.Tensor:
        return self.lora_a[slot]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base output plus each token's adapter delta (``x`` ``[..., in]``, leading dims = the step's tokens)."""
        y = self.base_layer(x)
        batch = self.batch
        if batch.token_slots is None:
            return y
        x2 = x.reshape(-1, self.in_features).to(self.lora_a.dtype)
        batch.check_tokens(x2.shape[0], self.layer_name)
        if batch.use_triton:
            return self._add_delta(y, _triton_ops().lora_shrink_triton(x2, self.lora_a, batch.segments()))
        return self._add_delta(y, shrink_masked(x2, self.lora_a.view(-1, self.in_features), batch.mask()))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, slots={self.batch.num_slots}"


class LoRAEmbedding(LoRALayer):
    """Wraps an ``nn.Embedding``; ``forward(ids) = base(ids) + B[slot_t] @ A[slot_t][:, ids_t]`` per token ``t``."""

    def __init__(self, base: nn.Embedding, name: str, batch: LoRABatch) -> None:
        super().__init__(base, name, base.num_embeddings, base.embedding_dim, batch)
        self.num_embeddings = base.num_embeddings
        self.embedding_dim = base.embedding_dim
        self.padding_idx = base.padding_idx
        shape = (self.in_features, batch.num_slots, batch.max_rank)
        self.register_buffer("lora_a", torch.zeros(shape, device=batch.device, dtype=batch.dtype), persistent=False)

    @property
    def a_stack(self) -> torch.Tensor:
        """``[L, R, vocab]``: the slots' A matrices (a view)."""
        return self.lora_a.permute(1, 2, 0)

    def _a_slot(self, slot: int) -> torch.Tensor:
        return self.lora_a[:, slot, :].t()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The base embedding plus each token's adapter delta (``ids`` of any shape, flattened = the step's tokens)."""
        y = self.base_layer(ids)
        batch = self.batch
        if batch.token_slots is None:
            return y
        ids2 = ids.reshape(-1)
        batch.check_tokens(ids2.shape[0], self.layer_name)
        if batch.use_triton:
            return self._add_delta(y, embedding_shrink(ids2, self.lora_a, batch.token_slots))
        a_all_t = self.lora_a.view(self.in_features, -1)
        return self._add_delta(y, shrink_embedding_masked(ids2, a_all_t, batch.mask()))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, slots={self.batch.num_slots}"


def wrap_targets(model: nn.Module, targets: ModelTargets, batch: LoRABatch) -> dict[str, LoRALayer]:
    """Replaces every module of ``targets`` in ``model`` by its LoRA layer reading ``batch``; returns the layers by
    module name (the names stay those of the base model; each base module moves to ``<name>.base_layer``)."""
    layers: dict[str, LoRALayer] = {}
    for name, spec in targets.modules.items():
        base = model.get_submodule(name)
        layer: LoRALayer
        if spec.kind == "embedding":
            assert isinstance(base, nn.Embedding)
            layer = LoRAEmbedding(base, name, batch)
        else:
            layer = LoRALinear(base, name, batch)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        layers[name] = layer
    return layers
