"""LoRA adapters: what a request names (:class:`LoRARequest`) and the engine's limits (:class:`LoRAConfig`).

The adapters' weights, their batched application and the host cache live with the executor that runs them
(``vllite.plugins.transformers_executor.lora``); the scheduler only counts distinct adapters per step.
"""

from vllite.lora.config import LoRAConfig
from vllite.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
