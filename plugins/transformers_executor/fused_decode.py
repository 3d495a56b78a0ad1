"""Decode steps of Llama-family models through the compiled CPU decode step (one call per step, not ~30 torch
operations per layer).

:func:`build_fused_decoder` looks at a loaded CPU model once: a transformers Llama, Mistral or Qwen2 (decoder layers
of exactly those classes) in float32 or bfloat16 with plain linear weights (float, contiguous, widths a multiple of
32; biases on Q, K and V only), SiLU MLPs, no sliding window and a rotary embedding that depends on the position only.
For such a model it hands the weights and a rotary table for every position up to ``max_model_len`` (computed by the
model's own rotary module, so rope scaling is whatever the model does) to
:mod:`vllite.kernels.cpu_decode_step`, and returns a :class:`FusedDecoder`; for any other model, or without the
kernel, ``None`` and the model runs as before. The model runner sends it pure decode steps of up to
:attr:`FusedDecoder.max_rows` sequences (16, the compiled linear kernel's limit, in both dtypes: on a ~30M Llama in
bfloat16 the step gives 2.3x the model forward's tokens/s at 4 sequences, 1.6x at 8 and 1.03x at 16, although torch's
bfloat16 matmul alone beats the row kernel from 4 rows on) whose every row's logits are kept; prefill, mixed steps,
speculative drafts, prompt logprobs, LoRA and KV connectors take the model's own forward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from vllite.kernels import cpu_linear
from vllite.kernels.cpu_decode_step import decode_step_kernel
from vllite.plugins.transformers_executor.attention import AttentionMetadata
from vllite.plugins.transformers_executor.decode_linear import DecodeLinear, PackedLinear

logger = logging.getLogger(__name__)

__all__ = ["FusedDecoder", "build_fused_decoder"]

#: Decoder layer classes whose forward the compiled step reproduces (pre-norm, rotary, GQA, SiLU-gated MLP).
SUPPORTED_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})
#: Rotary types whose tables depend on the position only (not on the sequence's length).
_POSITION_ONLY_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


class FusedDecoder:
    """One model's compiled decode step: :meth:`__call__` returns the float32 logits of a pure decode batch of up
    to :attr:`max_rows` sequences, or ``None`` for a batch it does not take (the caller runs the model instead)."""

    def __init__(self, impl: Any, vocab_size: int, max_rows: int, max_positions: int) -> None:
        self._impl = impl
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.max_positions = max_positions

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, kv_buffer: torch.Tensor
    ) -> torch.Tensor | None:
        n = md.num_tokens
        if not 0 < n <= self.max_rows or md.max_query_len != 1 or md.seq_lens.numel() != n:
            return None
        if md.max_seq_len > self.max_positions:
            return None
        logits = torch.empty(n, self.vocab_size, dtype=torch.float32)
        self._impl.step(
            logits,
            input_ids.reshape(-1),
            positions.reshape(-1),
            md.slot_mapping,
            md.block_tables,
            md.seq_lens,
            kv_buffer,
        )
        return logits


def _is_plain_linear(module: Any, dtype: torch.dtype, bias_allowed: bool) -> bool:
    """Whether ``module`` is a plain ``dtype`` linear layer whose weight the kernel can read."""
    if type(module) not in (nn.Linear, DecodeLinear, PackedLinear) or module.in_features % cpu_linear.GROUP_MULTIPLE:
        return False
    if module.weight.dtype != dtype or not module.weight.is_contiguous():
        return False
    return module.bias is None or bias_allowed


def _unsupported_reason(model: Any, dtype: torch.dtype) -> str | None:
    """Why ``model`` cannot run through the compiled step (``None``: it can)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not len(layers):
        return "no model.layers"
    config = getattr(model, "config", None)
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return f"activation {getattr(config, 'hidden_act', None)!r}"
    rope_type = getattr(getattr(inner, "rotary_emb", None), "rope_type", None)
    if rope_type not in _POSITION_ONLY_ROPE:
        return f"rotary type {rope_type!r}"
    for layer in layers:
        if type(layer).__name__ not in SUPPORTED_LAYERS:
            return f"decoder layer {type(layer).__name__}"
        attn, mlp = layer.self_attn, layer.mlp
        # Qwen2 keeps its layer's window on the attention module (None for full-attention layers), Mistral reads
        # the config's at each call.
        owner = attn if hasattr(attn, "sliding_window") else getattr(attn, "config", None)
        if getattr(owner, "sliding_window", None):
            return "a sliding window"
        for name in ("q_proj", "k_proj", "v_proj"):
            if not _is_plain_linear(getattr(attn, name), dtype, bias_allowed=True):
                return f"self_attn.{name} is not a plain {dtype} linear"
        for owner, name in ((attn, "o_proj"), (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")):
            if not _is_plain_linear(getattr(owner, name), dtype, bias_allowed=False):
                return f"{name} is not a plain {dtype} linear without bias"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not type(norm).__name__.endswith("RMSNorm") or norm.weight.dtype != dtype:
                return f"norm {type(norm).__name__}"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not _is_plain_linear(head, dtype, bias_allowed=False):
        return "the LM head is not a plain linear"
    if inner.embed_tokens.weight.dtype != dtype:
        return "embedding dtype"
    return None


def _rotary_tables(model: Any, dtype: torch.dtype, positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[positions, head_dim]`` float32 from the model's rotary module, rounded to the model's dtype;
    ``ValueError`` for a partial rotary embedding (the step rotates whole heads)."""
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=dtype), torch.arange(positions).unsqueeze(0))
    if cos.shape[-1] != head_dim:
        raise ValueError(f"a partial rotary embedding ({cos.shape[-1]} of {head_dim} dimensions)")
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def _layer_tensors(layers: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    """The 12 tensors per layer the compiled step takes, in its order (an empty tensor for a missing bias)."""
    empty = torch.empty(0, dtype=dtype)
    tensors: list[torch.Tensor] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        tensors += [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight]
        tensors += [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        tensors += [empty if p.bias is None else p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    return [t.detach().contiguous() for t in tensors]


@torch.inference_mode()
def build_fused_decoder(model: nn.Module, dtype: torch.dtype, max_model_len: int) -> FusedDecoder | None:
    """The compiled decode step for ``model`` (see the module docstring), or ``None``."""
    m: Any = model
    reason = _unsupported_reason(model, dtype)
    kernel = decode_step_kernel() if reason is None else None
    if reason is None and kernel is None:
        reason = "the compiled step is unavailable"
    if reason is None:
        attn = m.model.layers[0].self_attn
        head_dim = int(attn.head_dim)
        try:
            cos, sin = _rotary_tables(m, dtype, max_model_len, head_dim)
        except ValueError as exc:
            reason = str(exc)
    if reason is not None:
        logger.debug("Decode steps run the model's forward: %s", reason)
        return None
    assert kernel is not None
    norm, head = m.model.norm, m.get_output_embeddings()
    impl = kernel.DecodeStep(
        _layer_tensors(m.model.layers, dtype),
        m.model.embed_tokens.weight.detach(),
        norm.weight.detach(),
        head.weight.detach(),
        cos,
        sin,
        attn.q_proj.out_features // head_dim,
        attn.k_proj.out_features // head_dim,
        head_dim,
        float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))),
        float(attn.scaling),
    )
    logger.info("Decode steps of up to %d sequences run in the compiled CPU decode step", cpu_linear.MAX_ROWS)
    return FusedDecoder(impl, int(head.weight.shape[0]), cpu_linear.MAX_ROWS, max_model_len)
