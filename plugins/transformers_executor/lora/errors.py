"""The one error of the LoRA package: an adapter that cannot be served, or an adapter request that cannot be met."""

from __future__ import annotations

from vllite.exceptions import LoRAAdapterError

__all__ = ["LoRAAdapterError", "adapter_error"]


def adapter_error(name: str, problem: str) -> LoRAAdapterError:
    """``LoRAAdapterError("LoRA adapter 'name': problem")``, the house form of every message."""
    return LoRAAdapterError(f"LoRA adapter {name!r}: {problem}")
