"""Loading a model folder into a transformers model that attends through vllite's paged attention.

A model folder holds ``config.json`` and safetensors weights (tokenizer files are the frontend's concern).
The class comes from the ``vllite_register_models`` registry when a plugin registered the architecture,
otherwise from transformers' causal-LM auto mapping. Everything is loaded with ``local_files_only=True``.

``dtype="auto"`` takes the checkpoint's dtype (float32 when it names none), as vLLM's CPU build decides: on a CPU
a bfloat16 or float16 checkpoint runs in bfloat16 where the CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX,
where torch's bfloat16 matmuls run several times faster than float32 ones) and in float32 elsewhere (emulated
half-precision matmuls are slower than float32 and lose accuracy); float16 is never chosen on a CPU. A float32
checkpoint stays float32. An explicit ``--dtype`` is always honoured.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from vllite.exceptions import ModelLoadError
from vllite.plugins.transformers_executor.attention import register_attention

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSpec:
    """The shape facts the KV cache and the runner need, read from the model config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int  # of the keys (and the queries)
    vocab_size: int
    max_position_embeddings: int | None
    v_head_dim: int = 0  # of the values; 0: ``head_dim``

    def __post_init__(self) -> None:
        self.v_head_dim = self.v_head_dim or self.head_dim


def model_spec(hf_config: Any) -> ModelSpec:
    """Layer count, KV heads and head sizes as the attention layers will use them. Multi-head latent attention
    (DeepSeek-V2/V3, Kimi-K2: a ``kv_lora_rank``), as transformers runs it, hands the attention every head's
    decompressed keys (``qk_nope_head_dim + qk_rope_head_dim`` wide) and values (``v_head_dim`` wide)."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    v_head_dim = head_dim
    if getattr(cfg, "kv_lora_rank", None) and getattr(cfg, "v_head_dim", None):
        head_dim = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
        v_head_dim, num_kv_heads = int(cfg.v_head_dim), num_heads
    return ModelSpec(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=getattr(cfg, "max_position_embeddings", None),
        v_head_dim=v_head_dim,
    )


def resolve_dtype(requested: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """Turns ``auto`` / ``float32`` / ``bfloat16`` / ``float16`` into a torch dtype (see the module docstring)."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {requested!r}.")
        return _DTYPES[requested]
    cfg = getattr(hf_config, "text_config", None) or hf_config
    raw = cfg.__dict__.get("dtype") or cfg.__dict__.get("torch_dtype")
    if isinstance(raw, str):
        raw = _DTYPES.get(raw.removeprefix("torch."))
    if raw not in _DTYPES.values():
        return torch.float32
    if raw in (torch.float16, torch.bfloat16) and device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32
    return raw


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX tiles), where oneDNN's bfloat16 matmuls
    beat float32 ones; ``VLLITE_CPU_BF16=0``/``1`` overrides the detection."""
    forced = os.environ.get("VLLITE_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in ``/proc/cpuinfo`` (empty where there is none to read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def resolve_model_class(hf_config: Any) -> type[Any]:
    """The class for the config's architecture: a plugin-registered one first, then transformers' own."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    registry = _registered_models()
    for arch in architectures:
        if arch in registry:
            return registry[arch]
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm_names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        causal_lm_names.update([value] if isinstance(value, str) else value)
    candidates = [a for a in architectures if a in causal_lm_names]
    if not architectures:
        default = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", ""))
        candidates = [default] if isinstance(default, str) else list(default or [])
    for name in candidates:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    names = ", ".join(architectures) or getattr(hf_config, "model_type", "?")
    raise ModelLoadError(
        f"Unsupported model architecture {names}: transformers has no causal-LM class for it and no plugin "
        "registered one through vllite_register_models."
    )


def _registered_models() -> dict[str, type]:
    """Architectures contributed by ``vllite_register_models`` plugins ({} when the plugin manager lacks it)."""
    try:
        from vllite.plugin_manager import get_registry
    except ImportError:
        return {}
    try:
        return dict(get_registry("models"))
    except (KeyError, LookupError, ValueError):
        return {}


def load_model(
    path: str,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    *,
    trust_remote_code: bool = False,
    quantization: str | None = None,
) -> torch.nn.Module:
    """Instantiates the model with ``attn_implementation="vllite_paged"`` on ``device`` in eval mode; a quantized
    checkpoint (or ``quantization``, vLLM's ``--quantization``) keeps its weights packed (``.quantization``)."""
    from vllite.plugins.transformers_executor.quantization import load_quantized_model, resolve_quantization

    model_cls = resolve_model_class(hf_config)
    quant_spec = resolve_quantization(path, hf_config, quantization)
    attn = register_attention()
    import transformers

    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    kwargs = {dtype_kw: dtype, "attn_implementation": attn, "local_files_only": True}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    try:
        if quant_spec is not None:
            init_kwargs = {dtype_kw: dtype, "attn_implementation": attn}
            model = load_quantized_model(path, hf_config, quant_spec, model_cls, dtype, device, init_kwargs)
        else:
            model = model_cls.from_pretrained(path, config=hf_config, **kwargs)
    except ModelLoadError:
        raise
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot load the model weights from {path!r}: {exc}") from exc
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if device.type == "cpu":
        from vllite.plugins.transformers_executor.decode_linear import use_decode_linears

        use_decode_linears(model)
    logger.info("Loaded %s from %s (%s on %s)", model_cls.__name__, path, dtype, device)
    return model


def uniform_sliding_window(hf_config: Any) -> int | None:
    """The attention window when every layer uses the same sliding window, else ``None`` (full attention, or a
    hybrid model such as Gemma 2 whose global layers need every block)."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return window if all(kind == "sliding_attention" for kind in layer_types) else None
    if hasattr(cfg, "use_sliding_window") and not cfg.use_sliding_window:
        return None
    # Qwen2-style configs: the first ``max_window_layers`` layers attend fully.
    max_window_layers = getattr(cfg, "max_window_layers", None)
    if isinstance(max_window_layers, int) and max_window_layers > 0:
        return None
    return window
