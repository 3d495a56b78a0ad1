"""Which modules of a loaded transformers model can carry LoRA, and their shapes.

The targets are every linear projection inside the decoder layers (any module with integer ``in_features`` and
``out_features`` and no child modules, so ``nn.Linear`` and the packed layers of the sibling quantization package
alike, whose dotted name passes through a numbered entry of a module list, e.g. ``model.layers.3.mlp.up_proj``)
and the input embedding. The output projection (``lm_head``) is never a target: see
:data:`~vllite.plugins.transformers_executor.lora.peft_config.LM_HEAD_REASON`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

TargetKind = Literal["linear", "embedding"]


@dataclass(frozen=True)
class TargetSpec:
    """One target module: a ``linear`` maps ``in_features`` to ``out_features``; an ``embedding`` maps a token id
    below ``in_features`` (the vocabulary size) to a row of ``out_features``. ``base_weight`` is the embedding's
    table (to check a copy an adapter carries against); ``None`` for linear modules."""

    kind: TargetKind
    in_features: int
    out_features: int
    base_weight: torch.Tensor | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ModelTargets:
    """The LoRA targets of one model by dotted module name, plus the names of its output projections (refused)."""

    modules: dict[str, TargetSpec]
    output_modules: frozenset[str] = frozenset()

    def is_output_module(self, name: str) -> bool:
        """Whether ``name`` is the model's output projection (``lm_head``, also under any other name)."""
        return name in self.output_modules or name.split(".")[-1] == "lm_head"


def is_linear_like(module: nn.Module) -> bool:
    """A leaf module with integer ``in_features``/``out_features`` whose ``forward(x)`` maps ``[..., in]`` to
    ``[..., out]``: ``nn.Linear`` and vllite's packed quantized linear layers."""
    in_f = getattr(module, "in_features", None)
    out_f = getattr(module, "out_features", None)
    if not isinstance(in_f, int) or not isinstance(out_f, int):
        return False
    return next(module.children(), None) is None


def _in_layer_stack(name: str) -> bool:
    """Whether dotted ``name`` passes through a numbered module-list entry (a decoder layer)."""
    return any(part.isdigit() for part in name.split("."))


def find_targets(model: nn.Module) -> ModelTargets:
    """The LoRA targets of ``model`` (see the module docstring). The input embedding is found through
    ``get_input_embeddings()`` and taken when it is an ``nn.Embedding``."""
    output = _method_module(model, "get_output_embeddings")
    embedding = _method_module(model, "get_input_embeddings")
    modules: dict[str, TargetSpec] = {}
    output_names: set[str] = set()
    for name, module in model.named_modules():
        if module is output and name:
            output_names.add(name)
        elif isinstance(module, nn.Embedding) and module is embedding:
            modules[name] = TargetSpec("embedding", module.num_embeddings, module.embedding_dim, module.weight)
        elif is_linear_like(module) and _in_layer_stack(name):
            modules[name] = TargetSpec("linear", int(module.in_features), int(module.out_features))
    return ModelTargets(modules, frozenset(output_names))


def _method_module(model: nn.Module, method: str) -> nn.Module | None:
    """``model.<method>()`` when the model has it and it returns a module, else ``None``."""
    getter = getattr(model, method, None)
    if getter is None:
        return None
    try:
        found = getter()
    except (AttributeError, NotImplementedError):
        return None
    return found if isinstance(found, nn.Module) else None
