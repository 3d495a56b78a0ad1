"""Torch reference implementations of the paged KV-cache kernels; also the CPU execution path.

Cache layout (per layer): ``key_cache`` and ``value_cache`` are each
``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot ``s`` lives at block ``s // block_size``,
offset ``s % block_size``.

The attention here is vectorised over the batch: each sequence's context is gathered through its block
table into a padded ``[num_seqs, max_seq_len, num_kv_heads, head_dim]`` tensor, the packed queries are
scattered into ``[num_seqs, max_query_len, num_heads, head_dim]``, one batched matmul per KV head and one
masked float32 softmax run over all of them, and the result is packed back. Decode sequences (query
length 1) and the others are attended in two such groups so that one long prefill does not pad every decode
to its query length.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from vllite.kernels.kv_cache_dtype import dequantize_kv, quantize_kv
from vllite.kernels.params import PagedAttentionParams, gqa_group

__all__ = ["paged_attention_ref", "reshape_and_cache_ref"]

# Per-thread gather buffers, reused across layers and steps: a fresh multi-megabyte tensor per gather costs
# page faults that take longer than the copy itself.
_scratch = threading.local()


def _gather_blocks(cache: Tensor, blocks: Tensor, slot: int) -> Tensor:
    """``cache[blocks]`` written into a reused per-thread buffer; valid until the next gather of ``slot``."""
    buffers: dict = _scratch.__dict__.setdefault("buffers", {})
    key = (slot, cache.dtype, cache.device)
    row = cache[0].numel()
    numel = blocks.numel() * row
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        # A normal tensor even when first needed under inference_mode, so it can be written outside it too.
        with torch.inference_mode(False):
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            buf = buffers[key] = torch.empty(size, dtype=cache.dtype, device=cache.device)
    out = buf[:numel].view(blocks.numel(), *cache.shape[1:])
    return torch.index_select(cache, 0, blocks, out=out)


def reshape_and_cache_ref(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` rows into the paged caches in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``; cast to the cache dtype on write (an fp8 cache stores
            ``key / k_scale`` and ``value / v_scale`` saturated to the format's range, see
            :func:`~vllite.kernels.kv_cache_dtype.quantize_kv`).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides).
        slot_mapping: ``[num_tokens]`` integer; ``slot = block_id * block_size + offset``. A negative slot
            (``-1``) marks a padding token whose row is skipped.

    Returns nothing; only the cache entries at the given slots change.
    """
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    key_cache[blocks, offsets] = quantize_kv(key, key_cache.dtype, k_scale)
    value_cache[blocks, offsets] = quantize_kv(value, value_cache.dtype, v_scale)


def paged_attention_ref(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, params: PagedAttentionParams, *, out: Tensor | None = None
) -> Tensor:
    """Causal grouped-query attention of packed queries over a paged KV cache (mixed prefill + decode).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, the query tokens of all sequences back to back.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the K/V of this step's
            tokens must already be written (see :func:`reshape_and_cache_ref`). The values may have another head
            size than the keys (multi-head latent attention); the output then has theirs.
        params: the step's batch layout and the layer's scale, window, softcap and sinks (see
            :class:`~vllite.kernels.params.PagedAttentionParams`).
        out: optional ``[num_tokens, num_heads, value_head_dim]`` tensor to write into and return.

    Query token ``i`` of sequence ``s`` sits at position ``seq_lens[s] - query_len[s] + i`` and attends to
    key positions ``<= `` its own. An fp8 cache is read as ``element * params.k_scale`` (``v_scale`` for values).
    Scores, softmax and the weighted sum run in float32; the result has
    ``query``'s dtype. Rows of ``query`` past ``query_start_loc[-1]`` (padding) are left zero (or as they
    were in ``out``). ``num_heads`` must be a multiple of ``num_kv_heads``.
    """
    gqa_group(query, key_cache)
    if out is None:
        out = query.new_zeros((*query.shape[:2], value_cache.shape[3]))
    num_seqs = params.num_seqs
    if num_seqs == 0 or query.shape[0] == 0:
        return out

    device = query.device
    qsl = params.query_start_loc.to(device=device, dtype=torch.int64)
    query_lens = qsl[1:] - qsl[:-1]
    lens = params.seq_lens.to(device=device, dtype=torch.int64)
    is_decode = query_lens == 1
    n_decode = int(is_decode.sum())
    groups: list[tuple[Tensor | None, int, int]]
    if n_decode in (0, num_seqs):
        groups = [(None, params.max_query_len, params.max_seq_len)]
    else:
        groups = []
        for mask in (is_decode, ~is_decode):
            idx = mask.nonzero().squeeze(1)
            groups.append((idx, int(query_lens[idx].max()), int(lens[idx].max())))

    for seq_ids, group_q_len, group_seq_len in groups:
        if seq_ids is None:
            seq_ids = torch.arange(num_seqs, device=device)
        _attend_group(
            query,
            key_cache,
            value_cache,
            params.block_tables.to(device)[seq_ids].to(torch.int64),
            lens[seq_ids],
            qsl[seq_ids],
            query_lens[seq_ids],
            max_query_len=max(group_q_len, 1),
            max_seq_len=max(group_seq_len, 1),
            params=params,
            out=out,
        )
    return out


def _attend_group(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    q_starts: Tensor,
    query_lens: Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    params: PagedAttentionParams,
    out: Tensor,
) -> None:
    """Attend one group of sequences (padded to the group's maxima, with ``params``' scale, window and softcap)
    and scatter the rows into ``out``."""
    device = query.device
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads

    # Gather each sequence's context whole blocks at a time: float32 [S, L, Hkv, D], L = max_seq_len rounded
    # up to whole blocks; positions past a sequence's length are masked below.
    num_ctx_blocks = min(-(-max_seq_len // block_size), block_tables.shape[1])
    blocks = block_tables[:, :num_ctx_blocks].clamp(0, num_blocks - 1).reshape(-1)  # unused entries: any id
    ctx_len = num_ctx_blocks * block_size
    keys = _gather_blocks(key_cache, blocks, 0).view(num_seqs, ctx_len, num_kv_heads, head_dim)
    v_dim = value_cache.shape[3]
    values = _gather_blocks(value_cache, blocks, 1).view(num_seqs, ctx_len, num_kv_heads, v_dim)
    keys = dequantize_kv(keys, torch.float32, params.k_scale)
    values = dequantize_kv(values, torch.float32, params.v_scale)

    # Scatter the packed queries into [S, Mq, H, D].
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)
    first = torch.repeat_interleave(torch.cumsum(query_lens, 0) - query_lens, query_lens)
    local = torch.arange(seq_of_token.shape[0], device=device) - first
    token_rows = q_starts[seq_of_token] + local
    q = query.new_zeros((num_seqs, max_query_len, num_kv_heads, group, head_dim), dtype=torch.float32)
    q.view(num_seqs, max_query_len, num_heads, head_dim)[seq_of_token, local] = query[token_rows].float()

    # Per KV head h: [S, Mq*G, D] @ [S, D, L]. Slicing one head out of [S, L, Hkv, D] leaves matrices that
    # BLAS reads in place (row stride Hkv*D), so the context is never transposed into a copy.
    rows = max_query_len * group
    scores = torch.empty((num_kv_heads, num_seqs, rows, ctx_len), dtype=torch.float32, device=device)
    for h in range(num_kv_heads):
        q_h = q[:, :, h].reshape(num_seqs, rows, head_dim)
        torch.bmm(q_h, keys[:, :, h].transpose(1, 2), out=scores[h])
    scores = scores.view(num_kv_heads, num_seqs, max_query_len, group, ctx_len)
    scores.mul_(params.scale)
    softcap, sliding_window = params.softcap, params.sliding_window
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)

    pos = torch.arange(ctx_len, device=device)
    q_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_query_len, device=device)  # [S, Mq]
    allowed = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < seq_lens[:, None, None])
    if sliding_window is not None:
        allowed &= pos[None, None, :] > q_pos[:, :, None] - sliding_window
    scores.masked_fill_(~allowed[None, :, :, None, :], float("-inf"))
    if params.sinks is None:
        probs = torch.softmax(scores, dim=-1).view(num_kv_heads, num_seqs, rows, ctx_len)
    else:  # one more term per head in the softmax's denominator, the sink's, dropped from the weights
        sink = params.sinks.to(device=device, dtype=torch.float32).view(num_kv_heads, 1, 1, group, 1)
        with_sink = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(with_sink, dim=-1)[..., :ctx_len].reshape(num_kv_heads, num_seqs, rows, ctx_len)
    # A position no query sees may hold anything (a freed block's NaN, the null block of a window): its weight is
    # 0, but 0 * NaN is NaN, so its value row is zeroed (the masked_fill above already replaced its scores).
    values = values.masked_fill_(~allowed.any(1)[:, :, None, None], 0.0)

    ctx = torch.empty((num_kv_heads, num_seqs, rows, v_dim), dtype=torch.float32, device=device)
    for h in range(num_kv_heads):
        torch.bmm(probs[h], values[:, :, h], out=ctx[h])
    # [Hkv, S, Mq, G, D] -> [S, Mq, Hkv, G, D]; query head = kv_head * G + g. Padding rows are never read.
    ctx = ctx.view(num_kv_heads, num_seqs, max_query_len, group, v_dim).permute(1, 2, 0, 3, 4)
    out[token_rows] = ctx[seq_of_token, local].reshape(-1, num_heads, v_dim).to(out.dtype)
