"""The adapter a request runs with, as vLLM spells it (``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, eq=False):
    """A LoRA adapter in the PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``) at ``lora_path``.

    ``lora_int_id`` (≥ 1) is the engine's key for the adapter; ``lora_name`` is what users and the prefix cache
    see. Two requests are the same adapter when their names are equal (vLLM's rule).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be > 0, got {self.lora_int_id}.")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path is empty.")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    # vLLM's older names, still read by plugins.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def lora_per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    """One adapter (or ``None``) per prompt: a single one broadcast, a sequence taken as it is (``LLM``'s
    ``lora_request`` argument, for ``n`` prompts)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"The lengths of prompts ({n}) and lora_request ({len(loras)}) must be the same.")
    return loras
