"""Per-step plan of the CPU paged attention: which sequences run together, and the index tensors they need.

A step's batch is split into *buckets* of sequences that are attended by one
``scaled_dot_product_attention`` call each, padded only to the bucket's own longest context and query, so a
16-token decode is never padded to an 800-token neighbour. The plan depends only on the step's metadata (block
tables, sequence and query lengths, the layer's sliding window), so it is built once per forward pass and shared
by every layer (see :func:`plan_paged_attention_cpu`).

Sequences are grouped into classes that can share a bucket: each short query length (decode = 1, speculative
verification = 1 + k, short chunked-prefill continuations) is its own class, fresh prefills (no cached context,
no window) form one class attended with ``is_causal`` and no mask, and the other long queries (chunked prefill
over a cached context, windowed prefills) form one masked class. Within a class, sequences sorted by context are
cut into buckets greedily by a cost model: a new bucket costs a fixed per-call overhead, padding costs the work
of the padded keys; a cut is made where the padding it saves the remaining (shorter) sequences exceeds the
overhead. With a sliding window only the blocks the window can reach are attended.

Per bucket the plan holds the flat list of cache blocks to gather (one ``index_select`` per layer for all
buckets), the query rows (padded rows repeat the sequence's last query row), the gathered rows that hold no token of
their sequence (zeroed after each gather: see :meth:`CpuAttentionPlan.stale_rows`), and an additive float mask
``[num_seqs, 1, q_len, num_blocks * block_size]`` (``0`` where a key is visible, ``-inf`` elsewhere) built
lazily once per dtype; ``out_index`` maps each packed token back to its row of the bucket outputs. Index tensors
that would be the identity are ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["AttentionBucket", "CacheSlots", "CpuAttentionPlan", "plan_paged_attention_cpu"]

#: Query lengths up to this share buckets with others of the same length; longer ones are prefill-like.
SHORT_QUERY_MAX = 16
#: Estimated fixed cost of one bucket per layer (views, one SDPA call), in seconds.
BUCKET_OVERHEAD_S = 30e-6
#: Estimated cost of one element of padded work (one key position times one K/V or query element), in seconds.
ELEMENT_S = 0.2e-9

#: One bucket's sequences (indices, sorted) and whether it is causal (fresh prefills, no mask).
Group = tuple[np.ndarray, bool]


@dataclass
class AttentionBucket:
    """Sequences attended by one SDPA call: ``num_seqs`` x ``q_len`` query rows over ``num_blocks`` blocks each.

    ``q_start`` and ``kv_start`` are the bucket's first rows in the gathered query rows and gathered blocks.
    ``causal`` buckets (fresh prefills) need no mask; the others use :meth:`mask`.
    """

    num_seqs: int
    q_len: int
    num_blocks: int
    q_start: int
    kv_start: int
    causal: bool
    # Inputs of the mask, per sequence: first key position, first query position, sequence length.
    key_start: np.ndarray = field(repr=False)
    query_pos: np.ndarray = field(repr=False)
    seq_lens: np.ndarray = field(repr=False)
    block_size: int = 16
    sliding_window: int | None = None
    _masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[num_seqs, 1, q_len, num_blocks * block_size]`` in ``dtype`` (built once per dtype)."""
        cached = self._masks.get(dtype)
        if cached is not None:
            return cached
        base = self._masks.get(torch.float32)
        if base is None:
            kpos = self.key_start[:, None] + np.arange(self.num_blocks * self.block_size)  # [n, L]
            # Padded query rows (past a sequence's own query length) repeat its last position.
            qpos = np.minimum(self.query_pos[:, None] + np.arange(self.q_len), self.seq_lens[:, None] - 1)  # [n, Mq]
            allowed = (kpos[:, None, :] <= qpos[:, :, None]) & (kpos < self.seq_lens[:, None])[:, None, :]
            if self.sliding_window is not None:
                allowed &= kpos[:, None, :] > qpos[:, :, None] - self.sliding_window
            bias = np.where(allowed, np.float32(0.0), np.float32(-np.inf))[:, None]
            with torch.inference_mode(False):
                base = self._masks[torch.float32] = torch.from_numpy(np.ascontiguousarray(bias))
        if dtype != torch.float32:
            with torch.inference_mode(False):
                base = self._masks[dtype] = base.to(dtype)
        return base


class CacheSlots(NamedTuple):
    """A ``slot_mapping`` prepared for the CPU cache write: ``slots`` its non-negative entries (int64), ``rows``
    the rows of ``key``/``value`` they belong to (``None`` when no entry was dropped)."""

    slots: torch.Tensor
    rows: torch.Tensor | None

    @classmethod
    def of(cls, slot_mapping: torch.Tensor) -> CacheSlots:
        """``slot_mapping`` ``[num_tokens]`` with its ``-1`` (padding) entries dropped."""
        slots = slot_mapping.to(torch.int64)
        keep = slots >= 0
        if bool(keep.all()):
            return cls(slots, None)
        rows = keep.nonzero().squeeze(1)
        return cls(slots[rows], rows)


@dataclass
class CpuAttentionPlan:
    """Everything :func:`~vllite.kernels.cpu_attention.paged_attention_cpu` needs besides the tensors.

    ``block_index`` ``[total_blocks]`` int64: the cache blocks to gather, bucket after bucket.
    ``query_index`` ``[total_rows]`` int64 or ``None`` (identity): the packed query rows, bucket after bucket.
    ``out_index`` ``[num_valid_tokens]`` int64 or ``None`` (identity): each packed token's row of the bucket
    outputs concatenated. ``slots``: the cache-write slots prepared for
    :func:`~vllite.kernels.cpu_attention.reshape_and_cache_cpu`, or ``None`` when no slot mapping was given.
    ``block_tokens`` ``[total_blocks]``: how many leading slots of each gathered block hold a token of its sequence
    (fewer than ``block_size`` in a sequence's last block, 0 in a bucket's padding blocks).
    """

    block_size: int
    sliding_window: int | None
    num_valid_tokens: int
    buckets: list[AttentionBucket]
    block_index: torch.Tensor
    query_index: torch.Tensor | None
    out_index: torch.Tensor | None
    slots: CacheSlots | None = None
    block_tokens: np.ndarray | None = field(default=None, repr=False)
    _stale_rows: torch.Tensor | None = field(default=None, repr=False)

    def stale_rows(self) -> torch.Tensor:
        """The rows of the gathered ``[total_blocks * block_size]`` token rows that hold no token of their sequence
        (int64, built once): whatever they hold (a freed block's old keys, NaN from a model that made NaN, never
        written memory) is masked, but a masked weight times NaN is NaN, so the attention zeroes them first."""
        if self._stale_rows is None:
            bs = self.block_size
            tokens = np.zeros(0, dtype=np.int64) if self.block_tokens is None else self.block_tokens
            partial = np.nonzero(tokens < bs)[0]
            first, count = partial * bs + tokens[partial], bs - tokens[partial]
            offsets = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
            with torch.inference_mode(False):
                self._stale_rows = torch.from_numpy(np.repeat(first, count) + offsets)
        return self._stale_rows

    def matches(self, block_size: int, sliding_window: int | None) -> bool:
        """Whether this plan was built for ``block_size`` and ``sliding_window``."""
        return self.block_size == block_size and self.sliding_window == sliding_window


def _cut(lengths: np.ndarray, q_lens: np.ndarray, per_key: float, per_query_key: float) -> list[int]:
    """Bucket boundaries for sequences sorted by descending ``lengths`` (blocks); returns the cut positions.

    A cut before sequence ``i`` is made when the padding it saves the sequences from ``i`` on, at least
    ``(current_max - lengths[i])`` blocks each, costs more than a bucket's overhead.
    """
    cuts = [0]
    count = len(lengths)
    top = int(lengths[0])
    top_q = int(q_lens[0])
    for i in range(1, count):
        length = int(lengths[i])
        if length == top:
            top_q = max(top_q, int(q_lens[i]))
            continue
        saved = (count - i) * (top - length) * (per_key + per_query_key * top_q)
        if saved > BUCKET_OVERHEAD_S:
            cuts.append(i)
            top, top_q = length, int(q_lens[i])
        else:
            top_q = max(top_q, int(q_lens[i]))
    return cuts


def _group(q_lens: np.ndarray, num_blocks: np.ndarray, fresh: np.ndarray, kv_cost: float, q_cost: float) -> list[Group]:
    """The buckets: the sequences of each (sorted) and whether it is causal, ordered by their first sequence.

    ``kv_cost`` and ``q_cost`` are the estimated costs of one padded block of keys and values, and of one padded
    block times one query row (see :func:`_cut`).
    """
    # Class per sequence: its query length when short, else -1 (fresh prefill, causal) or -2 (masked).
    classes = np.where(q_lens <= SHORT_QUERY_MAX, q_lens, np.where(fresh, -1, -2))
    groups: list[Group] = []
    active = q_lens > 0  # a sequence with no query tokens this step has nothing to attend
    for cls in np.unique(classes[active]):
        members = np.nonzero((classes == cls) & active)[0]
        members = members[np.lexsort((-q_lens[members], -num_blocks[members]))]
        causal = bool(cls == -1)
        cuts = _cut(num_blocks[members], q_lens[members], kv_cost, q_cost * (0.5 if causal else 1.0))
        for a, b in zip(cuts, [*cuts[1:], len(members)]):
            groups.append((np.sort(members[a:b]), causal))
    groups.sort(key=lambda g: int(g[0][0]))
    return groups


def _gather_blocks(
    tables: np.ndarray,
    order: np.ndarray,
    seq_blocks: np.ndarray,
    first_block: np.ndarray,
    num_blocks: np.ndarray,
    lens: np.ndarray,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The blocks to gather: each sequence (in bucket ``order``) its ``seq_blocks`` blocks from its first reachable
    one, padded with block 0; and how many leading slots of each hold a token of its sequence."""
    rep = np.repeat(order, seq_blocks)
    col = np.arange(len(rep)) - np.repeat(np.cumsum(seq_blocks) - seq_blocks, seq_blocks)
    table_col = np.minimum(first_block[rep] + col, max(tables.shape[1] - 1, 0))
    inside = col < num_blocks[rep]
    block_index = np.where(inside, tables[rep, table_col] if len(rep) else 0, 0).astype(np.int64)
    block_tokens = np.clip(lens[rep] - (first_block[rep] + col) * block_size, 0, block_size)
    return block_index, block_tokens


def _query_rows(
    order: np.ndarray, seq_q: np.ndarray, q_lens: np.ndarray, qsl: np.ndarray, num_valid: int
) -> tuple[np.ndarray, np.ndarray]:
    """The query rows: each sequence (in bucket ``order``) its rows padded to ``seq_q`` by repeating its last row;
    and each packed token's row among them."""
    rep = np.repeat(order, seq_q)
    row = np.arange(len(rep)) - np.repeat(np.cumsum(seq_q) - seq_q, seq_q)
    valid = row < q_lens[rep]
    query_index = qsl[rep] + np.minimum(row, q_lens[rep] - 1)
    out_index = np.empty(num_valid, dtype=np.int64)
    out_index[query_index[valid]] = np.nonzero(valid)[0]
    return query_index, out_index


def _buckets(
    groups: list[Group],
    sizes: np.ndarray,
    bucket_q: np.ndarray,
    bucket_blocks: np.ndarray,
    mask_inputs: tuple[np.ndarray, np.ndarray, np.ndarray],
    block_size: int,
    sliding_window: int | None,
) -> list[AttentionBucket]:
    """One :class:`AttentionBucket` per group; ``mask_inputs`` are the key starts, query positions and lengths of
    the sequences in bucket order."""
    key_start, query_pos, seq_len = mask_inputs
    q_starts = np.cumsum(sizes * bucket_q) - sizes * bucket_q
    kv_starts = np.cumsum(sizes * bucket_blocks) - sizes * bucket_blocks
    seq_starts = np.cumsum(sizes) - sizes
    buckets = []
    for i, (_, causal) in enumerate(groups):
        span = slice(int(seq_starts[i]), int(seq_starts[i] + sizes[i]))
        buckets.append(
            AttentionBucket(
                num_seqs=int(sizes[i]),
                q_len=int(bucket_q[i]),
                num_blocks=int(bucket_blocks[i]),
                q_start=int(q_starts[i]),
                kv_start=int(kv_starts[i]),
                causal=causal,
                key_start=key_start[span],
                query_pos=query_pos[span],
                seq_lens=seq_len[span],
                block_size=block_size,
                sliding_window=sliding_window,
            )
        )
    return buckets


def plan_paged_attention_cpu(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> CpuAttentionPlan:
    """Plan one step's attention (see the module docstring); arguments as for ``paged_attention_ref``.

    ``num_heads``, ``num_kv_heads`` and ``head_dim`` only weigh padding against per-bucket overhead.
    ``slot_mapping``, when given, is also prepared for :func:`~vllite.kernels.cpu_attention.reshape_and_cache_cpu`.
    """
    tables = block_tables.cpu().numpy()
    lens = seq_lens.cpu().numpy().astype(np.int64)
    qsl = query_start_loc.cpu().numpy().astype(np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    num_valid = int(qsl[-1]) if len(qsl) else 0
    first_pos = lens - q_lens  # position of each sequence's first query token
    if sliding_window is not None:
        first_block = np.maximum(first_pos - sliding_window + 1, 0) // block_size
    else:
        first_block = np.zeros_like(lens)
    num_blocks = -(-lens // block_size) - first_block
    fresh = (first_pos == 0) & (sliding_window is None)
    kv_elems = 2 * num_kv_heads * head_dim * block_size * ELEMENT_S
    q_elems = 2 * num_heads * head_dim * block_size * ELEMENT_S
    groups = _group(q_lens, num_blocks, fresh, kv_elems, q_elems)

    # Every sequence in bucket order, with its bucket's padded block count and query length.
    order = np.concatenate([g[0] for g in groups]) if groups else np.zeros(0, dtype=np.int64)
    sizes = np.array([len(g[0]) for g in groups], dtype=np.int64)
    bucket_of = np.repeat(np.arange(len(groups)), sizes)
    bucket_blocks = np.zeros(len(groups), dtype=np.int64)
    bucket_q = np.zeros(len(groups), dtype=np.int64)
    np.maximum.at(bucket_blocks, bucket_of, num_blocks[order])
    np.maximum.at(bucket_q, bucket_of, q_lens[order])
    seq_blocks, seq_q = bucket_blocks[bucket_of], bucket_q[bucket_of]

    block_index, block_tokens = _gather_blocks(tables, order, seq_blocks, first_block, num_blocks, lens, block_size)
    query_index, out_index = _query_rows(order, seq_q, q_lens, qsl, num_valid)
    mask_inputs = first_block[order] * block_size, first_pos[order], lens[order]
    buckets = _buckets(groups, sizes, bucket_q, bucket_blocks, mask_inputs, block_size, sliding_window)
    num_rows = int((sizes * bucket_q).sum())

    identity = num_rows == num_valid and bool((query_index == np.arange(num_valid)).all())
    return CpuAttentionPlan(
        block_size=block_size,
        sliding_window=sliding_window,
        num_valid_tokens=num_valid,
        buckets=buckets,
        block_index=torch.from_numpy(block_index),
        query_index=None if identity else torch.from_numpy(query_index),
        out_index=None if identity else torch.from_numpy(out_index),
        slots=None if slot_mapping is None else CacheSlots.of(slot_mapping),
        block_tokens=block_tokens,
    )
