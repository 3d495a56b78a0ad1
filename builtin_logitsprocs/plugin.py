"""The builtin logits processors, registered through the same hook third-party plugins use.

Registration order is construction order: min tokens, logit bias, min-p (as in vLLM), then the thinking
budget.
The classes are imported inside the hook so that loading the plugin manager does not import torch.
"""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_logits_processors(register: Register) -> None:
    from .logit_bias import LogitBiasLogitsProcessor
    from .min_p import MinPLogitsProcessor
    from .min_tokens import MinTokensLogitsProcessor
    from .thinking_budget import ThinkingBudgetLogitsProcessor

    register("min_tokens", MinTokensLogitsProcessor)
    register("logit_bias", LogitBiasLogitsProcessor)
    register("min_p", MinPLogitsProcessor)
    register("thinking_budget", ThinkingBudgetLogitsProcessor)
