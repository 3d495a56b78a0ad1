"""The builtin reasoning parsers, under vLLM's ``--reasoning-parser`` names (see ``markers`` for the rules).

| name | family | section |
| --- | --- | --- |
| ``think`` | any model that thinks in ``<think>…</think>`` | opened by ``<think>`` (or the prompt) |
| ``deepseek_r1`` | DeepSeek-R1, QwQ | ``…</think>``: the template opens it, the reply may omit ``<think>`` |
| ``qwen3`` | Qwen3, Qwen3-2507, Qwen3.5 | ``<think>…</think>``; ``enable_thinking: false`` turns it off |
| ``deepseek_v3`` | DeepSeek-V3.1 | as ``deepseek_r1``, only with ``chat_template_kwargs={"thinking": true}`` |
| ``granite`` | Granite 3.2+ | ``Here is my thought process:`` … ``Here is my response:``, with ``thinking: true`` |
| ``mistral`` | Magistral | ``[THINK]…[/THINK]`` |
| ``openai_gptoss`` | gpt-oss (harmony) | the ``analysis`` channel; the content is the rest, final-channel framing off |
"""

from __future__ import annotations

from vllite.plugins.reasoning.markers import MarkerReasoningParser

_HARMONY_FINAL = "<|start|>assistant<|channel|>final<|message|>"


class ThinkReasoningParser(MarkerReasoningParser):
    """A ``<think>…</think>`` section opened by the reply (or left open by the prompt)."""


class DeepSeekR1ReasoningParser(MarkerReasoningParser):
    """DeepSeek-R1: reasoning up to ``</think>``, with or without a leading ``<think>`` (the template adds it)."""

    implicit_start = True


class Qwen3ReasoningParser(MarkerReasoningParser):
    """Qwen3: ``<think>…</think>``, generated or opened by the template; ``enable_thinking: false`` means content."""


class DeepSeekV3ReasoningParser(MarkerReasoningParser):
    """DeepSeek-V3.1: thinks (as R1) only when asked with ``chat_template_kwargs={"thinking": true}``."""

    implicit_start = True
    thinking_by_default = False


class GraniteReasoningParser(MarkerReasoningParser):
    """Granite 3.2+: ``Here is my thought process:`` … ``Here is my response:`` (``Here's`` too), when asked with
    ``chat_template_kwargs={"thinking": true}``."""

    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")
    thinking_by_default = False


class MistralReasoningParser(MarkerReasoningParser):
    """Magistral: ``[THINK]…[/THINK]`` (special tokens)."""

    start_markers = ("[THINK]",)
    end_markers = ("[/THINK]",)
    skip_special_tokens = False


class GptOssReasoningParser(MarkerReasoningParser):
    """gpt-oss: the ``analysis`` channel is the reasoning; the rest is the content, the final channel's header taken
    off (commentary-channel tool calls stay in harmony form for ``--tool-call-parser openai``)."""

    start_markers = ("<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>analysis<|message|>")
    end_markers = ("<|end|>" + _HARMONY_FINAL, "<|end|>")
    content_prefixes = (_HARMONY_FINAL, "<|channel|>final<|message|>")
    skip_special_tokens = False


REASONING_PARSERS: dict[str, type[MarkerReasoningParser]] = {
    "think": ThinkReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "deepseek_v3": DeepSeekV3ReasoningParser,
    "granite": GraniteReasoningParser,
    "mistral": MistralReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
}
