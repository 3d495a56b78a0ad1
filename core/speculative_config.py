"""``SpeculativeConfig``: vLLM's ``--speculative-config`` for n-gram (prompt-lookup) speculative decoding.

Users write it as vLLM users do::

    vllite generate --speculative-config '{"method": "ngram", "num_speculative_tokens": 3,
                                           "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3})

The result sits at ``config.speculative_config`` (``None`` without speculative decoding), with vLLM's attribute
names, so vLLM plugins that test ``vllm_config.speculative_config`` or read ``num_speculative_tokens`` see it.
Only the ``ngram`` method exists here: its drafter searches each request's own tokens, so it needs no second
model. Import-light (no torch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: The drafting methods vllite implements (vLLM's names).
SUPPORTED_METHODS = ("ngram",)
#: Methods vLLM knows that need a draft model or extra heads; named in the error so the user knows why.
_VLLM_MODEL_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "deepseek_mtp", "mtp")
#: vLLM's defaults for prompt lookup when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's ``SpeculativeConfig`` fields for the ``ngram`` method).

    ``num_speculative_tokens`` (k): drafts proposed per request and step. ``prompt_lookup_min`` /
    ``prompt_lookup_max``: the n-gram sizes the drafter tries, longest first; a request's last ``n`` tokens
    are looked up earlier in its prompt and output, and the ``k`` tokens that followed the most recent match
    are proposed. Build it with :meth:`from_dict` (which fills vLLM's defaults and validates); the
    constructor validates too.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP

    def __post_init__(self) -> None:
        if self.method not in SUPPORTED_METHODS:
            extra = " (it needs a draft model, which vllite does not run)" if self.method in _VLLM_MODEL_METHODS else ""
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SUPPORTED_METHODS)}, got {self.method!r}{extra}."
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})."
            )

    @classmethod
    def from_dict(cls, value: dict[str, Any] | str) -> SpeculativeConfig:
        """Parses vLLM's dict (or its JSON text). Unknown keys, a missing ``num_speculative_tokens`` and bad
        values raise ``ValueError`` naming the field. Given one lookup bound, the other takes its value; given
        neither, both are 5 (vLLM's defaults). vLLM's spelling ``{"model": "[ngram]"}`` means ``ngram``."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}.")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}."
            )
        method = value.get("method")
        model = value.get("model")
        if method is None and model in ("ngram", "[ngram]"):
            method = "ngram"
        elif model is not None and model not in ("ngram", "[ngram]"):
            raise ValueError(f"speculative_config.model must be absent or '[ngram]' (no draft models), got {model!r}.")
        if method is None:
            raise ValueError("speculative_config.method is required (supported: ngram).")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required.")
        low: Any = value.get("prompt_lookup_min")
        high: Any = value.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        elif low is None:
            low = high
        elif high is None:
            high = low
        return cls(
            method=method,
            num_speculative_tokens=value["num_speculative_tokens"],
            prompt_lookup_min=low,
            prompt_lookup_max=high,
        )

    @classmethod
    def resolve(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """``None`` stays ``None``; a ``SpeculativeConfig`` is kept; a dict or JSON text is parsed."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        return cls.from_dict(value)

    # vLLM attribute names plugins read.
    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a step may write past the verified tokens: one per draft (vLLM's name)."""
        return self.num_speculative_tokens

    def use_eagle(self) -> bool:
        """Whether the method is an EAGLE variant (never, here); vLLM's scheduler asks this."""
        return False
