"""The engine's LoRA limits, with vLLM's names (``--enable-lora`` and friends)."""

from __future__ import annotations

from dataclasses import dataclass

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoRAConfig:
    """``max_loras`` adapters may run in one step, each of rank ≤ ``max_lora_rank``; the host keeps up to
    ``max_cpu_loras`` loaded adapters (least recently used evicted first, pinned ones never); ``lora_dtype`` is
    the adapters' compute dtype (``auto``: the model's)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}.")

    @property
    def host_capacity(self) -> int:
        """How many adapters the host keeps loaded (``max_cpu_loras``, default ``max_loras``)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
