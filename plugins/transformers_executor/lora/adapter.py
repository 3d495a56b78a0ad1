"""Loading a PEFT LoRA adapter folder into host tensors, checked against the base model and the engine's limits.

A PEFT folder holds ``adapter_config.json`` (:mod:`.peft_config`) and ``adapter_model.safetensors``, whose tensors
are named ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` / ``.lora_B.weight`` ``[out, r]`` for linear
modules and ``base_model.model.<module>.lora_embedding_A`` ``[r, vocab]`` / ``.lora_embedding_B`` ``[hidden, r]``
for embeddings, ``<module>`` being the module's name in the base model. PEFT also saves the base embedding table
(``<module>.base_layer.weight``) of an adapter that targets ``embed_tokens``: it is checked to equal the model's
(a resized or retrained vocabulary is refused) and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vllite.lora import LoRARequest
from vllite.plugins.transformers_executor.lora.errors import adapter_error
from vllite.plugins.transformers_executor.lora.peft_config import LM_HEAD_REASON, PeftLoRAConfig, read_peft_config
from vllite.plugins.transformers_executor.lora.targets import ModelTargets, TargetSpec

WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_FILE = "adapter_model.bin"
_PREFIX = "base_model.model."
#: Tensor-name suffix → (the matrix, whether it is PEFT's embedding form).
_SUFFIXES = {
    ".lora_A.weight": ("A", False),
    ".lora_B.weight": ("B", False),
    ".lora_embedding_A": ("A", True),
    ".lora_embedding_B": ("B", True),
}
_BASE_LAYER = ".base_layer.weight"
_CHECK_ROWS = 4096  # rows of an embedding table compared at a time


@dataclass(frozen=True)
class LoRAWeights:
    """One module's low-rank update ``delta(x) = scaling * B @ (A @ x)``: ``a`` ``[r, in]``, ``b`` ``[out, r]``
    (for an embedding, ``in`` is the vocabulary and ``A @ x`` is column ``x`` of ``a``)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        """``r``, the inner dimension."""
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded, validated adapter: its identity and its :class:`LoRAWeights` per target module name. Modules it
    does not name run unchanged."""

    name: str
    int_id: int
    path: str
    modules: dict[str, LoRAWeights]

    @property
    def rank(self) -> int:
        """The largest rank of its modules."""
        return max(w.rank for w in self.modules.values())

    @property
    def nbytes(self) -> int:
        """The host memory its tensors take."""
        return sum(t.numel() * t.element_size() for w in self.modules.values() for t in (w.a, w.b))


def load_adapter(request: LoRARequest, targets: ModelTargets, max_rank: int) -> LoRAAdapter:
    """Reads the adapter at ``request.lora_path`` and checks it fits ``targets`` and ranks ≤ ``max_rank``.

    Raises :class:`~vllite.plugins.transformers_executor.lora.errors.LoRAAdapterError` naming the adapter and the
    problem: a missing folder or config, an unreadable file, an unsupported PEFT feature, a module the model lacks
    (or ``lm_head``), a tensor whose shape does not fit its module, or a rank above ``max_rank``.
    """
    name = request.lora_name
    folder = Path(request.lora_path)
    if not folder.is_dir():
        raise adapter_error(name, f"lora_path {request.lora_path!r} is not a folder")
    config = read_peft_config(folder, name)
    tensors = _read_tensors(folder, name)
    pairs = _pair_tensors(tensors, targets, name)
    if not pairs:
        raise adapter_error(name, f"{WEIGHTS_FILE} holds no LoRA A/B tensors")
    modules = {m: _module_weights(m, a, b, targets.modules[m], config, max_rank) for m, (a, b) in pairs.items()}
    return LoRAAdapter(name, request.lora_int_id, str(folder), modules)


def _read_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder/adapter_model.safetensors`` (a pickled ``.bin`` is refused, not unpickled)."""
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        if (folder / _PICKLE_FILE).is_file():
            raise adapter_error(
                name,
                f"only {_PICKLE_FILE} (a pickle) was found in {str(folder)!r}; vllite reads {WEIGHTS_FILE} only: "
                "re-save the adapter with save_pretrained(..., safe_serialization=True)",
            )
        raise adapter_error(name, f"{WEIGHTS_FILE} is missing in {str(folder)!r}")
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises its own error type (and OSError) for corrupt files
        raise adapter_error(name, f"cannot read {str(path)!r} (corrupt or not a safetensors file): {exc}") from exc


def _pair_tensors(
    tensors: dict[str, torch.Tensor], targets: ModelTargets, name: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A, B)}`` from PEFT's tensor names, each module checked to be a target of the model."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module_key = key.removeprefix(_PREFIX)
        if module_key.endswith(_BASE_LAYER):
            _check_base_copy(module_key.removesuffix(_BASE_LAYER), tensor, targets, name)
            continue
        suffix = next((s for s in _SUFFIXES if module_key.endswith(s)), None)
        if suffix is None:
            raise adapter_error(
                name,
                f"tensor {key!r} is not a LoRA A/B matrix (DoRA magnitudes, biases and saved modules are "
                "not supported)",
            )
        module = module_key.removesuffix(suffix)
        matrix, embedding_form = _SUFFIXES[suffix]
        spec = _target(module, targets, name)
        if embedding_form != (spec.kind == "embedding"):
            form = "an embedding" if embedding_form else "a linear"
            raise adapter_error(name, f"tensor {key!r} is {form} LoRA but module {module!r} is {spec.kind}")
        found.setdefault(module, {})[matrix] = tensor
    for module, parts in found.items():
        missing = {"A", "B"} - parts.keys()
        if missing:
            raise adapter_error(name, f"module {module!r} has no lora_{missing.pop()} tensor")
    return {module: (parts["A"], parts["B"]) for module, parts in found.items()}


def _target(module: str, targets: ModelTargets, name: str) -> TargetSpec:
    """``module``'s spec; raises for ``lm_head`` (with the reason) and for a module the model does not have."""
    if targets.is_output_module(module):
        raise adapter_error(name, f"targets {module!r}: {LM_HEAD_REASON}")
    spec = targets.modules.get(module)
    if spec is None:
        raise adapter_error(
            name,
            f"targets module {module!r}, which the base model does not have as a LoRA target (supported: the "
            "linear projections of the decoder layers and the input embedding)",
        )
    return spec


def _module_weights(
    module: str, a: torch.Tensor, b: torch.Tensor, spec: TargetSpec, config: PeftLoRAConfig, max_rank: int
) -> LoRAWeights:
    """One module's checked :class:`LoRAWeights`: float tensors of shapes ``[r, in]``/``[out, r]``, ``r`` equal to
    the config's rank for the module and ≤ ``max_rank``."""
    name = config.adapter_name
    for label, tensor in (("lora_A", a), ("lora_B", b)):
        if tensor.dim() != 2 or not tensor.is_floating_point():
            got = f"{tensor.dtype} {_shape(tensor)}"
            raise adapter_error(name, f"{module}.{label} must be a 2-D float tensor, got {got}")
    rank = int(a.shape[0])
    expected_a, expected_b = (rank, spec.in_features), (spec.out_features, rank)
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise adapter_error(
            name,
            f"the shapes of {module}'s weights do not fit the module ({spec.kind} {spec.in_features} -> "
            f"{spec.out_features}): lora_A is {_shape(a)} (expected {list(expected_a)}), lora_B is {_shape(b)} "
            f"(expected {list(expected_b)})",
        )
    if rank > max_rank:
        raise adapter_error(name, f"rank {rank} of {module} is above max_lora_rank={max_rank}")
    configured = config.rank_for(module)
    if rank != configured:
        raise adapter_error(name, f"{module} has rank {rank} but adapter_config.json gives it rank {configured}")
    return LoRAWeights(a.contiguous(), b.contiguous(), config.scaling_for(module))


def _check_base_copy(module: str, tensor: torch.Tensor, targets: ModelTargets, name: str) -> None:
    """Accepts PEFT's saved copy of an embedding table when it equals the model's; anything else is refused."""
    spec = _target(module, targets, name)
    weight = spec.base_weight
    if spec.kind != "embedding" or weight is None:
        raise adapter_error(name, f"carries a full weight for {module!r}: replaced base weights are not supported")
    if tuple(tensor.shape) != tuple(weight.shape):
        raise adapter_error(
            name,
            f"its copy of {module}'s table is {_shape(tensor)} but the model's is {_shape(weight)}: adapters with a "
            "resized vocabulary are not supported",
        )
    for start in range(0, tensor.shape[0], _CHECK_ROWS):
        mine = weight[start : start + _CHECK_ROWS].detach().float().cpu()
        theirs = tensor[start : start + _CHECK_ROWS].float()
        if not torch.allclose(mine, theirs, rtol=1e-2, atol=1e-3):
            raise adapter_error(
                name,
                f"its copy of {module}'s table differs from the model's (rows from {start}): adapters trained "
                "with a modified embedding table are not supported (or the adapter is for another base model)",
            )


def _shape(tensor: torch.Tensor) -> list[int]:
    return list(tensor.shape)
