"""Reading a PEFT LoRA adapter's ``adapter_config.json``: the fields that decide how its weights apply.

vllite serves plain LoRA: ``delta(x) = scaling * B @ (A @ x)`` on linear projections and the input embedding.
Every PEFT feature that changes that formula, adds trained tensors besides A and B, or replaces modules is refused
here with a message saying what and why, before any weight is read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllite.plugins.transformers_executor.lora.errors import adapter_error

CONFIG_FILE = "adapter_config.json"

#: Config fields that must be unset (null, false or empty), with why vllite does not serve them.
_UNSUPPORTED: tuple[tuple[str, str], ...] = (
    ("use_dora", "DoRA (use_dora) is not supported: its magnitude vector rescales each merged weight column"),
    (
        "modules_to_save",
        "modules_to_save is not supported: the adapter replaces whole modules ({value}) with trained copies, and "
        "vllite serves only the low-rank A/B deltas; merge the adapter into the model instead",
    ),
    ("lora_bias", "lora_bias is not supported: the adapter trains a bias for lora_B"),
    ("trainable_token_indices", "trainable_token_indices is not supported: it retrains rows of the embedding"),
    ("layer_replication", "layer_replication is not supported: it changes the model's layer stack"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
    ("use_qalora", "QA-LoRA (use_qalora) is not supported: it pools the input before lora_A"),
    ("target_parameters", "target_parameters is not supported: only modules, not bare parameters, are served"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora) is not supported"),
)

LM_HEAD_REASON = (
    "LoRA on lm_head is not served: the model runner computes logits only for the rows it keeps, through the "
    "base lm_head, so a delta there would be skipped; target the decoder layers (and embed_tokens) only"
)


@dataclass(frozen=True)
class PeftLoRAConfig:
    """An adapter's rank and scaling rules: ``r``/``lora_alpha`` with per-module overrides in ``rank_pattern`` /
    ``alpha_pattern`` (matched as PEFT does) and ``use_rslora`` (``alpha / sqrt(r)`` instead of ``alpha / r``)."""

    adapter_name: str
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank_for(self, module: str) -> int:
        """The rank PEFT gave ``module`` (a name in the base model, e.g. ``model.layers.0.self_attn.q_proj``)."""
        key = _pattern_key(self.rank_pattern, module)
        return self.r if key is None else self.rank_pattern[key]

    def scaling_for(self, module: str) -> float:
        """The factor PEFT multiplies ``module``'s ``B @ A`` by."""
        key = _pattern_key(self.alpha_pattern, module)
        alpha = self.lora_alpha if key is None else self.alpha_pattern[key]
        rank = self.rank_for(module)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_key(patterns: dict[str, Any], module: str) -> str | None:
    """The first pattern matching ``module`` the way PEFT's ``get_pattern_key`` matches (a suffix regex)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def read_peft_config(folder: Path, adapter_name: str) -> PeftLoRAConfig:
    """Reads and checks ``folder/adapter_config.json``; raises :class:`LoRAAdapterError` naming ``adapter_name``."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise adapter_error(adapter_name, f"{CONFIG_FILE} is missing in {str(folder)!r}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise adapter_error(adapter_name, f"cannot read {str(path)!r}: {exc}") from exc
    if not isinstance(raw, dict):
        raise adapter_error(adapter_name, f"{CONFIG_FILE} must hold a JSON object, got {type(raw).__name__}")
    _refuse_unsupported(raw, adapter_name)
    r: Any = raw.get("r")
    alpha: Any = raw.get("lora_alpha")
    if not _is_rank(r):
        raise adapter_error(adapter_name, f"{CONFIG_FILE}: r must be a positive integer, got {r!r}")
    if not _is_number(alpha):
        raise adapter_error(adapter_name, f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    return PeftLoRAConfig(
        adapter_name=adapter_name,
        r=r,
        lora_alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=_patterns(raw, "rank_pattern", adapter_name, integer=True),
        alpha_pattern=_patterns(raw, "alpha_pattern", adapter_name, integer=False),
    )


def _refuse_unsupported(raw: dict[str, Any], name: str) -> None:
    """Raises for a non-LoRA PEFT type, a trained bias, lm_head among the targets, or a field of ``_UNSUPPORTED``."""
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise adapter_error(name, f"peft_type is {peft_type!r}; only LORA adapters are served")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise adapter_error(name, f"bias={bias!r} is not supported (the adapter trains biases); only 'none' is")
    for key, reason in _UNSUPPORTED:
        value = raw.get(key)
        if value:
            raise adapter_error(name, reason.format(value=value))
    targets = raw.get("target_modules")
    if isinstance(targets, list) and any(str(t).split(".")[-1] == "lm_head" for t in targets):
        raise adapter_error(name, LM_HEAD_REASON)


def _patterns(raw: dict[str, Any], key: str, name: str, *, integer: bool) -> dict[str, Any]:
    """``raw[key]`` as ``{regex: value}``, checked: valid regexes, positive integers (ranks) or numbers (alphas)."""
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise adapter_error(name, f"{CONFIG_FILE}: {key} must be an object, got {type(value).__name__}")
    for pattern, setting in value.items():
        try:
            re.compile(pattern)
        except re.error as exc:
            raise adapter_error(name, f"{CONFIG_FILE}: {key} key {pattern!r} is not a valid pattern ({exc})") from exc
        if not (_is_rank(setting) if integer else _is_number(setting)):
            kind = "a positive integer" if integer else "a number"
            raise adapter_error(name, f"{CONFIG_FILE}: {key}[{pattern!r}] must be {kind}, got {setting!r}")
    return {str(p): (int(v) if integer else float(v)) for p, v in value.items()}


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
