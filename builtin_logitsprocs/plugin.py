"""The builtin logits processors, registered through the same hook third-party plugins use.

Registration order is construction order: min tokens, logit bias, min-p (as in vLLM), then the thinking
budget, then bad words, then repetition detection in the reasoning section.
The classes are registered by class path, so listing the registry (``vllite plugins``) does not import torch.
"""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_logits_processors(register: Register) -> None:
    register("min_tokens", f"{__package__}.min_tokens:MinTokensLogitsProcessor")
    register("logit_bias", f"{__package__}.logit_bias:LogitBiasLogitsProcessor")
    register("min_p", f"{__package__}.min_p:MinPLogitsProcessor")
    register("thinking_budget", f"{__package__}.thinking_budget:ThinkingBudgetLogitsProcessor")
    register("bad_words", f"{__package__}.bad_words:BadWordsLogitsProcessor")
    register("repetition_detection", f"{__package__}.repetition_detection:RepetitionDetectionLogitsProcessor")
