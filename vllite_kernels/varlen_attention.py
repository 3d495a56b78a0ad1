"""Attention over a packed batch of whole sequences without a KV cache: bidirectional (encoders) or causal.

:func:`varlen_attention` attends each sequence of the packed batch to its own tokens only: all of them
(``causal=False``, BERT-style encoders) or those at or before each query (``causal=True``). Grouped-query heads
map query head ``h`` to KV head ``h // (num_heads // num_kv_heads)``. Float32 and bfloat16 (any floating dtype
SDPA takes) are supported; scores, softmax and output accumulate in float32 (the Triton kernel does so itself,
SDPA's fused kernels likewise).

CUDA tensors take the Triton kernel of :mod:`vllite.kernels.triton_varlen_attention` when
:func:`vllite.kernels.use_triton` allows it. Everything else takes torch's ``scaled_dot_product_attention``, one
call per sequence on views of the packed rows, except for sequences so short that a call costs more than their
attention: those (see :func:`plan_buckets`) are gathered, padded to their bucket's longest, into
``[n, heads, L, dim]`` and attended by one call per bucket with a key-padding mask. Measured on CPU, padding and
the copies it needs outweigh the call they save from a few tokens on, because SDPA's work grows with the square
of the length while a call's overhead is fixed.

Importing this module imports neither torch nor triton (:mod:`vllite.kernels` re-exports
:func:`varlen_attention`).
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["plan_buckets", "varlen_attention"]

# Cost model of the SDPA path, per thread (measured with torch 2.13 on an AVX2 EPYC; see plan_buckets).
#: One more SDPA call on a short sequence (the call, its views, its output copy), in seconds.
CALL_S = 20e-6
#: One element copied by a gather or scatter (fresh multi-megabyte buffers fault pages: up to ~4x more), in seconds.
COPY_S = 1e-9
#: One (query, key) pair times one head dimension of float32 bidirectional attention (0.07-0.2 ns measured),
#: in seconds; causal pairs count half.
PAIR_S = 0.1e-9


def varlen_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    scale: float,
    causal: bool = False,
) -> Tensor:
    """Attention within each sequence of a packed batch; returns ``[T, num_heads, head_dim]`` in ``query``'s dtype.

    ``query`` ``[T, num_heads, head_dim]``; ``key``/``value`` ``[T, num_kv_heads, head_dim]`` of the same dtype,
    ``num_heads`` a multiple of ``num_kv_heads``; ``cu_seqlens`` ``[num_seqs + 1]`` integer offsets: sequence
    ``s`` is rows ``cu_seqlens[s]:cu_seqlens[s + 1]`` (empty sequences are allowed). ``max_seqlen`` bounds the
    sequence lengths (the Triton path sizes its launch with it instead of reading ``cu_seqlens`` on the host).
    ``scale`` multiplies ``q @ k``. ``causal=False`` lets every token see its whole sequence; ``causal=True``
    only itself and the tokens before it. Rows past ``cu_seqlens[-1]`` are zero.
    """
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"expected query [T, heads, dim] and key/value [T, kv_heads, dim]; got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(f"key/value {tuple(key.shape)} do not match query {tuple(query.shape)} in tokens or dim")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"num_heads={query.shape[1]} is not a multiple of num_kv_heads={key.shape[1]}")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"query, key and value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be [num_seqs + 1]; got shape {tuple(cu_seqlens.shape)}")

    from vllite.kernels.dispatch import use_triton

    if use_triton(query):
        from vllite.kernels.triton_varlen_attention import varlen_attention_triton

        return varlen_attention_triton(query, key, value, cu_seqlens, max_seqlen, scale, causal)
    return _varlen_attention_sdpa(query, key, value, cu_seqlens.tolist(), float(scale), causal)


def plan_buckets(
    lengths: list[int], *, num_heads: int, num_kv_heads: int, head_dim: int, causal: bool, num_threads: int
) -> list[list[int]]:
    """The SDPA path's calls: indices of the non-empty ``lengths``, longest first, one list per SDPA call.

    A sequence joins others only when the call it saves (:data:`CALL_S`) costs more than gathering its rows
    into a padded batch and scattering them back (``2 * (num_heads + num_kv_heads) * head_dim`` elements per
    row, :data:`COPY_S`): on one thread that is a few tokens, since SDPA's own work grows with the square of the
    length. Those short sequences, sorted by length, are cut into buckets where the padding a cut saves the rest
    (at least ``top**2 - length**2`` pairs each, :data:`PAIR_S`) costs more than a call. ``num_threads`` divides
    the copies and the arithmetic, not the per-call overhead, so more threads batch longer sequences.
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    threads = max(num_threads, 1)
    row_copy = 2 * (num_heads + num_kv_heads) * head_dim * COPY_S / threads
    per_pair = PAIR_S * num_heads * head_dim * (0.5 if causal else 1.0) / threads
    buckets = [[i] for i in order if lengths[i] * row_copy >= CALL_S]
    short = order[len(buckets) :]
    top = 0
    for j, i in enumerate(short):
        length = lengths[i]
        if j == 0 or (len(short) - j) * (top * top - length * length) * per_pair > CALL_S:
            buckets.append([i])
            top = length
        else:
            buckets[-1].append(i)
    return buckets


def _heads_first(rows: Tensor) -> Tensor:
    """``[L, heads, dim]`` -> ``[1, heads, L, dim]`` (a view)."""
    return rows.transpose(0, 1).unsqueeze(0)


def _varlen_attention_sdpa(
    query: Tensor, key: Tensor, value: Tensor, starts: list[int], scale: float, causal: bool
) -> Tensor:
    """The SDPA path of :func:`varlen_attention` (see the module docstring); ``starts`` is ``cu_seqlens``."""
    import torch
    import torch.nn.functional as F

    num_tokens, num_heads, head_dim = query.shape
    gqa = num_heads != key.shape[1]
    lengths = [b - a for a, b in pairwise(starts)]
    if len(lengths) == 1 and starts[0] == 0 and lengths[0] == num_tokens:
        q, k, v = _heads_first(query), _heads_first(key), _heads_first(value)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)

    covered = starts[0] == 0 and starts[-1] == num_tokens and min(lengths, default=0) >= 0
    new = torch.empty if covered else torch.zeros
    out = new(query.shape, dtype=query.dtype, device=query.device)
    buckets = plan_buckets(
        lengths,
        num_heads=num_heads,
        num_kv_heads=key.shape[1],
        head_dim=head_dim,
        causal=causal,
        num_threads=torch.get_num_threads(),
    )
    for bucket in buckets:
        if len(bucket) == 1:
            rows = slice(starts[bucket[0]], starts[bucket[0] + 1])
            q, k, v = _heads_first(query[rows]), _heads_first(key[rows]), _heads_first(value[rows])
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
            out[rows] = o[0].transpose(0, 1)
            continue
        n, max_len = len(bucket), lengths[bucket[0]]
        first = torch.tensor([starts[s] for s in bucket], device=query.device)
        lens = torch.tensor([lengths[s] for s in bucket], device=query.device)
        pos = torch.arange(max_len, device=query.device)
        valid = pos < lens[:, None]  # [n, L]
        # Padding rows repeat the sequence's last row: masked keys must still hold finite values, or their zero
        # weights times inf/NaN garbage would poison the output.
        index = (first[:, None] + torch.minimum(pos, lens[:, None] - 1)).view(-1)
        q, k, v = (t.index_select(0, index).view(n, max_len, *t.shape[1:]).transpose(1, 2) for t in (query, key, value))
        # Causal needs no mask: padding sits after each sequence's tokens, beyond what a real query row sees.
        mask = None if causal or lengths[bucket[-1]] == max_len else valid[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
        seq, row = valid.nonzero(as_tuple=True)
        out.index_copy_(0, first[seq] + row, o.transpose(1, 2)[seq, row])
    return out
