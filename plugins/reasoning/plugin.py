"""The builtin reasoning-parser plugin: registers ``REASONING_PARSERS`` through the hook third parties use."""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_reasoning_parsers(register: Register) -> None:
    """Registers ``think``, ``deepseek_r1``, ``qwen3``, ``deepseek_v3``, ``granite``, ``mistral`` and
    ``openai_gptoss`` (imported when first used)."""
    for name, cls_name in _CLASSES.items():
        register(name, f"vllite.plugins.reasoning.builtin:{cls_name}")


_CLASSES = {
    "think": "ThinkReasoningParser",
    "deepseek_r1": "DeepSeekR1ReasoningParser",
    "qwen3": "Qwen3ReasoningParser",
    "deepseek_v3": "DeepSeekV3ReasoningParser",
    "granite": "GraniteReasoningParser",
    "mistral": "MistralReasoningParser",
    "openai_gptoss": "GptOssReasoningParser",
}
