"""Paged attention for transformers models: our function behind ``attn_implementation="vllite_paged"``.

The model runner runs a transformers model over a *packed* batch (``input_ids`` of shape ``[1, num_tokens]``,
per-token ``position_ids``) with ``use_cache=False``. Before the forward pass it publishes the step's
:class:`AttentionMetadata` and the per-layer KV caches with :func:`forward_context`; every attention layer then
calls :func:`paged_attention_forward`, which writes the layer's new keys and values into the paged cache and
attends over each sequence's cached context.

transformers builds no attention mask for an attention implementation it does not know a mask function for
(``masking_utils._preprocess_mask_arguments`` exits early), so no ``O(num_tokens^2)`` mask is created; the kernel
applies causality per sequence from the metadata.

Encoder layers (``module.is_causal`` false, as in BERT) take the encoder path instead: no KV cache is written or
read; each sequence attends bidirectionally to its own tokens of this step through
:func:`vllite.kernels.varlen_attention`. That needs every sequence's whole input in this one step (no prefix
caching, no chunked prefill), which the first encoder layer of a forward checks once for all.

With a KV connector (``--kv-transfer-config``) the runner also publishes the connector and the per-layer KV
tensors: each layer then calls ``wait_for_layer_load(name)`` before it touches the cache and
``save_kv_layer(name, kv_layer, attn_metadata=...)`` after it wrote this step's keys and values; ``name`` is
:func:`kv_layer_name`. Without a connector this costs one attribute test per layer.

The first layer of a forward with a given sliding window builds the kernels' arguments for it
(:class:`vllite.kernels.PagedAttentionParams`: the step's metadata, the layer's scale, window and softcap) and
caches them on the forward context, so the other layers pass them on without building anything. With vllite's own
kernels they carry the step's attention plan (``vllite.kernels.plan_paged_attention``: on CPU, the length buckets,
gather indices, masks and cache-write slots), also built once per distinct sliding window, which the cache write
gets as ``plan=``. Kernels installed with :func:`set_kernels` get no plan.

An fp8 KV cache (``--kv-cache-dtype fp8``) keeps queries, keys and values in the model's dtype up to the kernels:
the cache write quantizes with the layer's ``k_scale`` / ``v_scale`` (the runner's ``kv_scales``, published with the
caches) and the attention kernels dequantize as they read (``PagedAttentionParams.k_scale`` / ``v_scale``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from vllite.exceptions import AttentionRoutingError
from vllite.kernels import varlen_attention
from vllite.kernels.kv_cache_dtype import is_fp8
from vllite.kernels.params import PagedAttentionParams
from vllite.plugins.transformers_executor.architecture_guard import check_attention_kwargs

ATTN_IMPLEMENTATION = "vllite_paged"

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class AttentionMetadata:
    """Per-step layout of the packed batch, shared by every layer.

    ``slot_mapping[t]`` is the cache slot (``block_id * block_size + offset``) of token ``t`` (-1 = do not write);
    ``block_tables[s]`` the blocks of sequence ``s``; ``seq_lens[s]`` its context length including this step's
    tokens; ``query_start_loc[s]:query_start_loc[s + 1]`` its tokens in the packed batch.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    # A model with several KV-cache groups (kv_cache_layout.py): each group's metadata (its own slot mapping and
    # block tables; this one is group 0's), read by the layers of that group. Empty: one group.
    groups: tuple[AttentionMetadata, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def kv_layer_name(layer_idx: int) -> str:
    """The name a KV connector knows layer ``layer_idx``'s KV tensor by (``register_kv_caches`` and per layer)."""
    return f"model.layers.{layer_idx}.self_attn"


@dataclass
class _ForwardContext:
    metadata: AttentionMetadata
    kv_caches: Sequence[KVCache]
    num_calls: int = 0  # attention calls in this forward (the runner checks every layer came through us)
    kv_connector: Any = None  # the worker-role KV connector, if one is configured
    kv_layers: Sequence[torch.Tensor] = ()  # per layer [2, num_blocks, block_size, heads, dim] (with a connector)
    kv_scales: Sequence[tuple[float, float]] = ()  # per layer (k_scale, v_scale) of an fp8 cache; () = all 1.0
    # Kernel plans and arguments of this forward, per (metadata: a KV-cache group's, sliding window).
    plans: dict[tuple[int, int | None], Any] = field(default_factory=dict)
    params: dict[tuple[int, int | None], PagedAttentionParams] = field(default_factory=dict)
    whole_inputs: bool = False  # every sequence's whole input is in this step (set by the first encoder layer)
    check_arguments: bool = False  # check what each call passes (the start-up probe forward; off per step)
    layer_groups: Sequence[int] = ()  # per layer, its KV-cache group (metadata.groups); () = one group


_local = threading.local()


@contextmanager
def forward_context(
    metadata: AttentionMetadata,
    kv_caches: Sequence[KVCache],
    kv_connector: Any = None,
    kv_layers: Sequence[torch.Tensor] = (),
    kv_scales: Sequence[tuple[float, float]] = (),
    check_arguments: bool = False,
    layer_groups: Sequence[int] = (),
) -> Iterator[_ForwardContext]:
    """Publishes the step's metadata and KV caches (and the KV connector with the per-layer KV tensors it saves
    from, when there is one, and an fp8 cache's per-layer ``(k_scale, v_scale)``) to the attention layers for the
    duration of a forward."""
    previous = getattr(_local, "ctx", None)
    ctx = _local.ctx = _ForwardContext(
        metadata,
        kv_caches,
        kv_connector=kv_connector,
        kv_layers=kv_layers,
        kv_scales=kv_scales,
        check_arguments=check_arguments,
        layer_groups=layer_groups,
    )
    try:
        yield ctx
    finally:
        _local.ctx = previous


def get_forward_context() -> _ForwardContext:
    """The context set by :func:`forward_context`; raises if the model runs outside one."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise AttentionRoutingError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the attention metadata of a vllite model runner; "
            "the model was called outside vllite.plugins.transformers_executor.attention.forward_context()."
        )
    return ctx


# The kernels (vllite.kernels), resolved on first use so this module imports without them; the planner is
# vllite.kernels.plan_paged_attention while those kernels are in use, None once set_kernels replaced them.
_kernels: tuple[Callable[..., Any], Callable[..., Any]] | None = None
_planner: Callable[..., Any] | None = None


def set_kernels(reshape_and_cache: Callable[..., Any], paged_attention: Callable[..., Any]) -> None:
    """Overrides the cache-write and attention kernels (tests, alternative backends); they get no plan.

    They are called as ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)`` and
    ``paged_attention(query, key_cache, value_cache, params)`` with a :class:`vllite.kernels.PagedAttentionParams`.
    """
    global _kernels, _planner
    _kernels = (reshape_and_cache, paged_attention)
    _planner = None


def get_kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(reshape_and_cache, paged_attention)`` from ``vllite.kernels`` unless overridden."""
    global _kernels, _planner
    if _kernels is None:
        from vllite.kernels import paged_attention, plan_paged_attention, reshape_and_cache

        _kernels = (reshape_and_cache, paged_attention)
        _planner = plan_paged_attention
    return _kernels


def _step_plan(
    ctx: _ForwardContext, md: AttentionMetadata, key_cache: torch.Tensor, num_heads: int, sliding_window: int | None
) -> Any:
    """The forward's kernel plan for ``sliding_window`` over ``md`` (a KV-cache group's), built by the first layer
    that needs it."""
    key = (id(md), sliding_window)
    if key in ctx.plans:
        return ctx.plans[key]
    assert _planner is not None
    plan = ctx.plans[key] = _planner(
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        key_cache=key_cache,
        num_heads=num_heads,
        sliding_window=sliding_window,
        slot_mapping=md.slot_mapping,
    )
    return plan


def _layer_params(
    ctx: _ForwardContext,
    md: AttentionMetadata,
    key_cache: torch.Tensor,
    num_heads: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> PagedAttentionParams:
    """The forward's kernel arguments for a layer with these settings over ``md`` (its KV-cache group's metadata),
    built by the first layer that has them."""
    key = (id(md), window)
    params = ctx.params.get(key)
    if (
        params is None
        or params.scale != scale
        or params.softcap != softcap
        or (params.k_scale, params.v_scale) != kv_scales
    ):
        params = ctx.params[key] = PagedAttentionParams(
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len,
            scale=scale,
            sliding_window=window,
            softcap=softcap,
            k_scale=kv_scales[0],
            v_scale=kv_scales[1],
            plan=None if _planner is None else _step_plan(ctx, md, key_cache, num_heads, window),
        )
    return params


def _check_whole_inputs(ctx: _ForwardContext) -> None:
    """Raises unless every sequence's whole input is in this step; checked by the forward's first encoder layer."""
    if ctx.whole_inputs:
        return
    md = ctx.metadata
    query_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    partial = (query_lens != md.seq_lens).nonzero()
    if partial.numel():
        s = int(partial[0, 0])
        raise AttentionRoutingError(
            f"bidirectional (encoder) attention needs each sequence's whole input in one step, but sequence {s} has "
            f"{int(md.seq_lens[s])} tokens of which {int(query_lens[s])} are in this step (cached context or a "
            "chunked prefill): chunked prefill and prefix caching must be off for encoder models."
        )
    ctx.whole_inputs = True


def _encoder_attention(
    ctx: _ForwardContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """The encoder path: each sequence attends to all of its tokens in this step; no cache is written or read."""
    _check_whole_inputs(ctx)
    md = ctx.metadata
    q = query[0].transpose(0, 1)  # [T, heads, dim]
    k = key[0].transpose(0, 1).to(query.dtype)
    v = value[0].transpose(0, 1).to(query.dtype)
    out = varlen_attention(q, k, v, md.query_start_loc, md.max_query_len, scale, causal=False)
    return out.unsqueeze(0)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, heads, T, dim]``, ``key/value [1, kv_heads, T, dim]``.

    Writes ``key``/``value`` into layer ``module.layer_idx``'s cache, attends causally per sequence, and returns
    ``([1, T, heads, dim], None)`` as transformers expects. ``attention_mask`` is ignored (causality comes from
    the metadata); ``scaling``, ``sliding_window`` and ``softcap`` fall back to the module's attributes; ``s_aux``
    (gpt-oss's attention sinks, one logit per query head) adds one term per head to the softmax. Keys and values may
    have different head sizes (multi-head latent attention as transformers runs it); the output has the values'. A
    module
    whose ``is_causal`` is false (an encoder layer) takes the encoder path instead (see the module docstring):
    bidirectional attention over this step's tokens, no cache, the same shapes returned.
    """
    ctx = get_forward_context()
    ctx.num_calls += 1
    if ctx.check_arguments and kwargs:
        check_attention_kwargs(module, kwargs)
    md = ctx.metadata
    if query.shape[0] != 1:
        raise ValueError(f"vllite runs a packed batch of shape [1, num_tokens]; got batch size {query.shape[0]}.")
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    if softcap is None:
        softcap = getattr(module, "attn_logit_softcapping", None)
    if not getattr(module, "is_causal", True):
        if sliding_window or softcap or s_aux is not None:
            raise AttentionRoutingError(
                f"{type(module).__name__} is bidirectional with a sliding window, softcap or attention sinks, which "
                "vllite's encoder attention does not support."
            )
        return _encoder_attention(ctx, query, key, value, float(scaling)), None
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise AttentionRoutingError(f"{type(module).__name__} has no layer_idx; vllite cannot find its KV cache.")
    key_cache, value_cache = ctx.kv_caches[layer_idx]

    window = int(sliding_window) if sliding_window else None
    reshape_and_cache, paged_attention = get_kernels()
    cap = float(softcap) if softcap else None
    fp8 = is_fp8(key_cache.dtype)
    kv_scales = ctx.kv_scales[layer_idx] if fp8 and ctx.kv_scales else (1.0, 1.0)
    if ctx.layer_groups:  # this layer's KV-cache group: its own block tables and slots
        md = md.groups[ctx.layer_groups[layer_idx]]
    params = _layer_params(ctx, md, key_cache, query.shape[1], float(scaling), window, cap, kv_scales)
    if s_aux is not None:  # per layer: the sinks are the layer's own weights
        params = dataclasses.replace(params, sinks=s_aux)
    write_kw: dict[str, Any] = {} if _planner is None else {"plan": params.plan}
    if fp8:
        write_kw.update(k_scale=kv_scales[0], v_scale=kv_scales[1])
    connector = ctx.kv_connector
    if connector is not None:
        connector.wait_for_layer_load(kv_layer_name(layer_idx))
    # Attention runs in the cache's dtype, or for an fp8 cache in the model's (the kernels widen what they read).
    compute = query.dtype if fp8 else key_cache.dtype
    q = query[0].transpose(0, 1)  # [T, heads, dim]
    k = key[0].transpose(0, 1).to(compute)
    v = value[0].transpose(0, 1).to(compute)
    reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping, **write_kw)
    if connector is not None:
        connector.save_kv_layer(kv_layer_name(layer_idx), ctx.kv_layers[layer_idx], attn_metadata=md)
    out = paged_attention(q.to(compute).contiguous(), key_cache, value_cache, params)
    return out.to(query.dtype).unsqueeze(0), None


def register_attention() -> str:
    """Registers :func:`paged_attention_forward` with transformers (idempotent); returns the implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
