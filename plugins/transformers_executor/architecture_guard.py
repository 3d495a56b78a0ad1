"""Refuse, before serving, a model the executor would run wrongly: a clear ``ModelLoadError`` instead of wrong tokens.

The executor runs transformers' modeling code with one hook (the attention interface) over one KV layout, the same
paged full-attention cache for every layer. What that cannot serve is refused at start-up, naming the architecture
and the missing feature:

- from the config (:func:`check_architecture`, before the weights load): layers that are not attention (Mamba and
  Mamba-2 SSM layers, gated-delta-net and other linear attention, Falcon-H1's hybrid layers), whose state the KV
  cache does not keep; multi-head latent attention in another layout than DeepSeek-V2/V3's (``qk_nope_head_dim``,
  ``qk_rope_head_dim``, ``v_head_dim``: keys and values of their own sizes, which the cache holds); encoder-decoder
  models;
- from the attention calls of a probe forward at start-up (:func:`check_attention_kwargs`; not per step):
  arguments that change the attention's result and that vllite's kernels do not implement (an unknown tensor).
  gpt-oss's attention sinks (``s_aux``) the kernels implement.
"""

from __future__ import annotations

from typing import Any

import torch

from vllite.exceptions import AttentionRoutingError, ModelLoadError

#: Layer kinds (``config.layer_types``, as transformers names them) the paged attention serves.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})

#: Attention-call arguments vllite does not implement -> the feature they carry (gpt-oss's ``s_aux`` sinks it does).
UNSUPPORTED_ATTENTION_ARGS = {"sinks": "attention sinks passed under another name than gpt-oss's s_aux"}

#: Tensor-valued attention-call arguments that vllite reads or may ignore: the packed batch's metadata stands in.
IGNORED_TENSOR_ARGS = frozenset(
    {"position_ids", "cache_position", "attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "position_embeddings"}
)


def architecture_name(hf_config: Any) -> str:
    """The model's architecture as a user knows it: ``config.architectures[0]``, else its ``model_type``."""
    architectures = getattr(hf_config, "architectures", None) or ()
    return str(architectures[0]) if architectures else str(getattr(hf_config, "model_type", "this model"))


def check_architecture(hf_config: Any) -> None:
    """Raises ``ModelLoadError`` for an architecture whose config shows a feature vllite cannot run (see the
    module docstring); returns for one it can."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    missing = _missing_feature(hf_config, cfg)
    if missing is not None:
        raise ModelLoadError(
            f"{architecture_name(hf_config)} cannot run on vllite: it needs {missing}, which vllite does not "
            "implement (see docs/architecture.md). Refused at start-up rather than giving wrong tokens."
        )


def _missing_feature(hf_config: Any, cfg: Any) -> str | None:
    if getattr(hf_config, "is_encoder_decoder", False):
        return "an encoder-decoder model (cross-attention over an encoder's output)"
    other = sorted({str(kind) for kind in getattr(cfg, "layer_types", None) or ()} - ATTENTION_LAYER_TYPES)
    if other:
        return f"layers that keep a recurrent state ({', '.join(other)} layers: Mamba, SSM or linear attention)"
    if getattr(cfg, "kv_lora_rank", None) and not (hasattr(cfg, "qk_nope_head_dim") and hasattr(cfg, "v_head_dim")):
        return f"multi-head latent attention in a layout vllite does not know (kv_lora_rank={cfg.kv_lora_rank})"
    return None


def check_attention_kwargs(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Raises ``AttentionRoutingError`` when an attention call passes an argument that changes the result and that
    vllite does not implement (an unknown tensor, or a known unsupported feature such as attention sinks)."""
    for name, value in kwargs.items():
        if value is None:
            continue
        feature = UNSUPPORTED_ATTENTION_ARGS.get(name)
        if feature is None and isinstance(value, torch.Tensor) and name not in IGNORED_TENSOR_ARGS:
            feature = f"an attention argument vllite does not read ({name!r})"
        if feature is not None:
            raise AttentionRoutingError(
                f"{type(module).__name__} passes {feature} ({name}=...), which vllite's attention does not implement."
            )
