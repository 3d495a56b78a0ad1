"""Loading a pooling model: the transformers class for its task, with vllite's attention, and the facts the
engine needs from it (tasks, pooling type, whether its attention is bidirectional).

An embedding model runs as its base model (``BertModel``, ``Qwen3Model``: the hidden states), also when the
checkpoint is a causal LM or carries a head. A classification model runs as its ``*ForSequenceClassification``
class; its head is applied to the pooled states (:class:`~.pooler.ClassificationHead`). A checkpoint without the
head's weights is refused rather than run with a random head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from vllite.exceptions import ModelLoadError
from vllite.plugins.transformers_executor.attention import register_attention
from vllite.plugins.transformers_executor.pooling.setup import PoolingSetup

logger = logging.getLogger(__name__)


@dataclass
class LoadedPoolingModel:
    """The loaded model and what loading settled: the module that returns hidden states (``base``), the
    pooling type, and whether attention is bidirectional (an encoder)."""

    model: torch.nn.Module
    base: torch.nn.Module
    setup: PoolingSetup
    pooling_type: str
    bidirectional: bool

    @property
    def no_chunked_prefill(self) -> str | None:
        if self.bidirectional:
            return "the model's attention is bidirectional, so each input must run whole in one step"
        return None

    @property
    def no_prefix_caching(self) -> str | None:
        if self.bidirectional:
            return "the model's attention is bidirectional: a cached prefix depends on the tokens after it"
        if self.pooling_type != "LAST":  # token tasks, which read every position too, skip the cache (a salt)
            return f"the pooler ({self.pooling_type} pooling) reads every prompt position"
        return None


def load_pooling_model(
    path: str, hf_config: Any, setup: PoolingSetup, dtype: torch.dtype, device: torch.device, trust_remote_code: bool
) -> LoadedPoolingModel:
    """Loads the model in ``path`` for ``setup`` (see the module docstring)."""
    model_cls: Any = _model_class(hf_config, setup.kind)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": register_attention(), "local_files_only": True}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a causal LM's lm_head is expected to be left out: no load report for it
    try:
        model, info = model_cls.from_pretrained(path, config=hf_config, output_loading_info=True, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot load the model weights from {path!r}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = [key for key in info.get("missing_keys", ()) if key.split(".")[0] in ("score", "classifier")]
    if missing:
        raise ModelLoadError(
            f"{path!r} has no classification head weights ({', '.join(sorted(missing))}); a classify model needs a "
            "checkpoint trained with one (a *ForSequenceClassification checkpoint)."
        )
    model.to(device).eval().requires_grad_(False)
    base = model.base_model if setup.kind == "classify" else model
    bidirectional = any(getattr(m, "is_causal", True) is False for m in base.modules())
    pooling_type = setup.pooling_type or ("CLS" if bidirectional else "LAST")
    logger.info(
        "Loaded %s from %s as a pooling model (%s, %s pooling, %s attention; %s on %s)",
        model_cls.__name__, path, setup.kind, pooling_type, "bidirectional" if bidirectional else "causal", dtype,
        device,
    )  # fmt: skip
    return LoadedPoolingModel(model, base, setup, pooling_type, bidirectional)


def _model_class(hf_config: Any, kind: str) -> type:
    import transformers
    from transformers.models.auto import modeling_auto

    model_type = getattr(hf_config, "model_type", "")
    mapping = (
        modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
        if kind == "classify"
        else modeling_auto.MODEL_MAPPING_NAMES
    )
    name = mapping.get(model_type)
    if isinstance(name, (list, tuple)):
        name = name[0]
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        what = "classification" if kind == "classify" else "base (embedding)"
        raise ModelLoadError(f"transformers has no {what} model class for model type {model_type!r}.")
    return cls
