"""LoRA adapters in the transformers executor: many adapters in one batch, applied punica-style.

- :mod:`.errors`: :class:`LoRAAdapterError`, raised for any adapter that cannot be served;
- :mod:`.peft_config`, :mod:`.adapter`: reading and checking a PEFT adapter folder into host tensors;
- :mod:`.targets`: which modules of a model can carry LoRA;
- :mod:`.punica`, :mod:`.punica_triton`: the batched ops (torch; Triton kernels on CUDA);
- :mod:`.batch`, :mod:`.layers`: the per-step slot of each token, and the layers that replace the targets;
- :mod:`.host_cache`, :mod:`.slots`, :mod:`.manager`: the loaded adapters, their device slots, and the manager the
  model runner drives.

The request-side types (:class:`vllite.lora.LoRARequest`, :class:`vllite.lora.LoRAConfig`) live in the core.
"""

from vllite.plugins.transformers_executor.lora.adapter import LoRAAdapter, LoRAWeights, load_adapter
from vllite.plugins.transformers_executor.lora.batch import LoRABatch
from vllite.plugins.transformers_executor.lora.errors import LoRAAdapterError
from vllite.plugins.transformers_executor.lora.layers import LoRAEmbedding, LoRALayer, LoRALinear
from vllite.plugins.transformers_executor.lora.manager import LoRAModelManager
from vllite.plugins.transformers_executor.lora.targets import ModelTargets, TargetSpec, find_targets

__all__ = [
    "LoRAAdapter",
    "LoRAAdapterError",
    "LoRABatch",
    "LoRAEmbedding",
    "LoRALayer",
    "LoRALinear",
    "LoRAModelManager",
    "LoRAWeights",
    "ModelTargets",
    "TargetSpec",
    "find_targets",
    "load_adapter",
]
