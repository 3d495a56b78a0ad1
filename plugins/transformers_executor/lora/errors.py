"""The one error of the LoRA package: an adapter that cannot be served, or an adapter request that cannot be met."""

from __future__ import annotations

from vllite.exceptions import VlliteError


class LoRAAdapterError(VlliteError, ValueError):
    """A LoRA adapter cannot be loaded or run; the message names the adapter and exactly what is wrong (a
    ``ValueError`` too, as vLLM raises for bad adapters, so an HTTP layer answers 400)."""


__all__ = ["LoRAAdapterError", "adapter_error"]


def adapter_error(name: str, problem: str) -> LoRAAdapterError:
    """``LoRAAdapterError("LoRA adapter 'name': problem")``, the house form of every message."""
    return LoRAAdapterError(f"LoRA adapter {name!r}: {problem}")
