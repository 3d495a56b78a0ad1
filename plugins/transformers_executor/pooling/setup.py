"""What a pooling model is, settled once when it loads: its tasks, pooling type, defaults and the class to load.

The defaults follow vLLM. A sentence-transformers folder (``modules.json``) says its pooling mode in the pooling
module's ``config.json`` and normalizes when it lists a ``Normalize`` module. Otherwise an embedding model pools
the first token (CLS) of a bidirectional encoder and the last token of a decoder, and normalizes; a
classification model pools the same way and applies softmax (sigmoid for a single label). ``--pooler-config``
overrides ``pooling_type``, ``normalize``, ``dimensions`` and ``use_activation``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from vllite.exceptions import ModelLoadError

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")
_CLASSIFY_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForRewardModel")
_ST_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_OVERRIDES = ("pooling_type", "normalize", "dimensions", "use_activation", "step_tag_id", "returned_token_ids")


@dataclass(frozen=True)
class PoolingSetup:
    """The pooling model's settled facts: ``kind`` (``"embed"`` or ``"classify"``), the pooling type (``None``:
    CLS for an encoder, LAST for a decoder, decided once the model is loaded) and the per-request defaults."""

    kind: str
    pooling_type: str | None
    normalize: bool
    use_activation: bool
    dimensions: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        if self.kind == "embed":
            return ("embed", "token_embed")
        return ("classify", "score", "token_classify")


def resolve_pooling_setup(
    folder: str, hf_config: Any, convert: str, pooler_config: dict[str, Any] | None
) -> PoolingSetup:
    """The :class:`PoolingSetup` of the model in ``folder`` (see the module docstring)."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    kind = "classify" if any(a.endswith(_CLASSIFY_SUFFIXES) for a in architectures) else "embed"
    if convert in ("embed", "classify"):
        kind = convert
    pooling_type, normalize = _sentence_transformers(folder)
    settings: dict[str, Any] = {
        "pooling_type": pooling_type,
        "normalize": normalize if normalize is not None else kind == "embed",
        "use_activation": True,
        "dimensions": None,
        "step_tag_id": None,
        "returned_token_ids": None,
    }
    for key, value in (pooler_config or {}).items():
        if key not in _OVERRIDES:
            raise ValueError(f"--pooler-config has an unknown key {key!r}; known: {', '.join(_OVERRIDES)}.")
        settings[key] = value
    if settings["pooling_type"] is not None:
        settings["pooling_type"] = str(settings["pooling_type"]).upper()
        if settings["pooling_type"] not in POOLING_TYPES:
            raise ValueError(
                f"--pooler-config pooling_type {settings['pooling_type']!r} is not one of {', '.join(POOLING_TYPES)}."
            )
    if settings["returned_token_ids"] is not None:
        settings["returned_token_ids"] = tuple(settings["returned_token_ids"])
    return PoolingSetup(kind=kind, **settings)


def _sentence_transformers(folder: str) -> tuple[str | None, bool | None]:
    """The pooling type and normalization a sentence-transformers folder declares (``None``: not one)."""
    modules_path = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules_path):
        return None, None
    with open(modules_path, encoding="utf-8") as f:
        modules = json.load(f)
    pooling_type = None
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Dense"):
            raise ModelLoadError(
                f"{folder}: sentence-transformers Dense modules are not supported yet ({module.get('path')!r})."
            )
        if kind.endswith("Pooling"):
            pooling_type = _st_pooling_mode(os.path.join(folder, module.get("path", ""), "config.json"))
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    return pooling_type, normalize


def _st_pooling_mode(config_path: str) -> str | None:
    if not os.path.isfile(config_path):
        return None
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    modes = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    unsupported = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if unsupported or len(modes) > 1:
        raise ModelLoadError(
            f"{config_path}: pooling modes {unsupported or modes} are not supported (one of CLS, MEAN, LAST)."
        )
    return modes[0] if modes else None
