"""The builtin logits processors: min-p, logit bias, min tokens, the thinking budget, bad words and repetition
detection in the reasoning section.

They are ordinary plugins (see :mod:`vllite.builtin_logitsprocs.plugin`), and the engine reaches them
through the plugin registry. The classes are loaded on first attribute access, so importing the package
(as the plugin manager does) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "MinTokensLogitsProcessor": "min_tokens",
    "LogitBiasLogitsProcessor": "logit_bias",
    "MinPLogitsProcessor": "min_p",
    "ThinkingBudgetLogitsProcessor": "thinking_budget",
    "BadWordsLogitsProcessor": "bad_words",
    "RepetitionDetectionLogitsProcessor": "repetition_detection",
}

__all__ = [*_LAZY, "BUILTIN_LOGITS_PROCESSORS"]


def __getattr__(name: str) -> Any:
    if name == "BUILTIN_LOGITS_PROCESSORS":
        # Construction order, as in vLLM: min tokens, logit bias, min-p; then the thinking budget, bad words and
        # repetition detection.
        value: Any = [__getattr__(cls_name) for cls_name in _LAZY]
    elif name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
