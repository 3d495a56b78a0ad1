"""What a pooling model is, settled once when it loads: its tasks, pooling type, defaults and the class to load.

The defaults follow vLLM. A sentence-transformers folder (``modules.json``) says its pooling mode in the pooling
module's ``config.json`` (``"pooling_mode": "mean"`` as current sentence-transformers writes it, or the older
``pooling_mode_*_tokens`` booleans; neither: its default, mean) and normalizes when it lists a ``Normalize``
module. A mode vllite cannot pool the same way (``max``, ``weightedmean``, several at once), or a module other than
Transformer, Pooling and Normalize, is refused at load. Otherwise an embedding model pools the first token (CLS) of
a bidirectional encoder and the last token of a decoder, and normalizes; a classification model pools the same way
and applies softmax (sigmoid for a single label). ``--pooler-config`` overrides ``pooling_type``, ``normalize``,
``dimensions`` and ``use_activation``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from vllite.exceptions import ModelLoadError

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")
_CLASSIFY_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForRewardModel")
# sentence-transformers' pooling modes vllite pools the same way; the legacy booleans name the same modes.
_ST_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_ST_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_MODULES = ("Transformer", "Pooling", "Normalize")  # the sentence-transformers modules vllite runs
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
        if not kind.endswith(_ST_MODULES):
            raise ModelLoadError(
                f"{modules_path}: the sentence-transformers module {kind!r} is not supported (vllite runs "
                f"{', '.join(_ST_MODULES)}); its embeddings would differ from the model's."
            )
        if kind.endswith("Pooling"):
            pooling_type = _st_pooling_mode(os.path.join(folder, module.get("path", ""), "config.json"))
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    return pooling_type, normalize


def _st_pooling_mode(config_path: str) -> str:
    """The pooling type of a sentence-transformers pooling module's ``config.json``, in either format (see the
    module docstring); ``ModelLoadError`` naming the file and the value for a mode vllite does not pool."""
    config: dict[str, Any] = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path}: a pooling config must be a JSON object, got {config!r}.")
    unknown = [k for k in config if k.startswith("pooling_mode_") and k not in _ST_LEGACY_KEYS]
    if unknown:
        raise ModelLoadError(f"{config_path}: unknown pooling mode keys {unknown}; vllite pools {_st_supported()}.")
    if "pooling_mode" in config:
        mode, where = config["pooling_mode"], "pooling_mode"
        if isinstance(mode, list) and len(mode) == 1:
            mode = mode[0]
    else:
        legacy = [key for key in _ST_LEGACY_KEYS if config.get(key)]
        modes = [_ST_LEGACY_KEYS[key] for key in legacy] or ["mean"]  # none set: sentence-transformers pools the mean
        mode = modes[0] if len(modes) == 1 else modes
        where = ", ".join(legacy) if legacy else "pooling_mode"
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise ModelLoadError(
            f"{config_path}: {where} {mode!r} is not a pooling mode vllite supports ({_st_supported()}); "
            "its embeddings would differ from the model's."
        )
    return _ST_MODES[mode]


def _st_supported() -> str:
    return ", ".join(f"{mode!r}" for mode in _ST_MODES)
