"""A step's model inputs, written in place into persistent buffers from the persistent batch's arrays.

``StepBuffers`` holds CPU tensors (token ids, positions, slot mapping, sequence lengths, query start locations)
that live across steps; their numpy views are filled by vectorised numpy operations on ``InputBatch``'s arrays,
so a step builds no tensor from Python lists and allocates none of these. A pure decode step (every request
computes one token) skips the per-token index arithmetic: positions are the computed-token counts, query start
locations a fixed ``0 .. n`` range.

The tensors handed to the model are views of the buffers, valid until the next step's :func:`prepare_inputs`.
``stable_metadata=True`` (a KV connector may keep the attention metadata beyond the step) copies the
metadata tensors out of the buffers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllite.plugins.transformers_executor.attention import AttentionMetadata
from vllite.plugins.transformers_executor.input_batch import InputBatch


class StepBuffers:
    """Persistent CPU tensors for one step's inputs, with numpy views sharing their memory."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int = 0) -> None:
        self.max_num_reqs = max_num_reqs
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32)
        self.decode_query_start_loc = torch.arange(max_num_reqs + 1, dtype=torch.int32)
        self.rows = np.arange(max_num_reqs, dtype=np.int64)
        self.num_tokens_capacity = 0
        self.input_ids = self.positions = self.slot_mapping = torch.empty(0, dtype=torch.int64)
        self.reserve_tokens(max(max_num_tokens, max_num_reqs))

    def reserve_tokens(self, num_tokens: int) -> None:
        """Makes room for ``num_tokens`` tokens per step (grows by doubling; contents are not kept)."""
        if num_tokens <= self.num_tokens_capacity:
            return
        size = max(num_tokens, 2 * self.num_tokens_capacity)
        self.input_ids = torch.zeros(size, dtype=torch.int64)
        self.positions = torch.zeros(size, dtype=torch.int64)
        self.slot_mapping = torch.zeros(size, dtype=torch.int64)
        self.num_tokens_capacity = size


def prepare_inputs(
    batch: InputBatch,
    num_scheduled: np.ndarray,
    block_size: int,
    buffers: StepBuffers,
    device: torch.device,
    *,
    stable_metadata: bool = False,
    num_drafts: np.ndarray | None = None,
    num_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The packed ``[1, num_tokens]`` input ids and positions and the attention metadata of rows
    ``0 .. len(num_scheduled)-1``, which compute ``num_scheduled[i]`` tokens each (all > 0). ``num_drafts[i]``
    draft tokens (speculative decoding) may follow row ``i``'s known tokens in ``batch.token_ids``.

    ``ValueError`` when a request is scheduled past its known tokens or has no KV block for a position.
    """
    num_reqs = len(num_scheduled)
    max_query_len = int(num_scheduled.max())
    computed = batch.num_computed_tokens[:num_reqs]
    seq_lens_np = buffers.seq_lens.numpy()[:num_reqs]
    if max_query_len == 1:  # pure decode: one token per request, at position num_computed_tokens
        total = num_reqs
        buffers.reserve_tokens(total)
        row_of_token = buffers.rows[:num_reqs]
        positions = buffers.positions.numpy()[:total]
        np.copyto(positions, computed)
        seq_lens = computed + 1
        query_start_loc = buffers.decode_query_start_loc[: num_reqs + 1]
    else:
        cu = np.cumsum(num_scheduled)
        total = int(cu[-1])
        buffers.reserve_tokens(total)
        row_of_token = np.repeat(buffers.rows[:num_reqs], num_scheduled)
        positions = buffers.positions.numpy()[:total]
        np.subtract(np.arange(total), np.repeat(cu - num_scheduled, num_scheduled), out=positions)
        positions += computed[row_of_token]
        seq_lens = computed + num_scheduled
        query_start_loc = buffers.query_start_loc[: num_reqs + 1]
        qsl = query_start_loc.numpy()
        qsl[0] = 0
        qsl[1:] = cu
    known = batch.num_tokens[:num_reqs] if num_drafts is None else batch.num_tokens[:num_reqs] + num_drafts
    if (seq_lens > known).any():
        row = int(np.argmax(seq_lens > known))
        raise ValueError(
            f"Request {batch.req_ids[row]!r} is scheduled past its known tokens "
            f"({int(seq_lens[row])} > {int(known[row])})."
        )
    block_idx = positions // block_size * num_groups  # the groups' tables interleaved: position k of g at k*G + g
    no_block = block_idx >= batch.num_blocks[row_of_token]
    if no_block.any():
        t = int(np.argmax(no_block))
        raise ValueError(
            f"Request {batch.req_ids[row_of_token[t]]!r} has no KV block for position {int(positions[t])}."
        )
    slots = buffers.slot_mapping.numpy()[:total]
    np.multiply(batch.block_table[row_of_token, block_idx], block_size, out=slots)
    slots += positions % block_size
    buffers.input_ids.numpy()[:total] = batch.token_ids[row_of_token, positions]
    seq_lens_np[:] = seq_lens
    max_seq_len = int(seq_lens.max())
    max_blocks = -(-max_seq_len // block_size) * num_groups
    slot_mapping, seq_lens_t = buffers.slot_mapping[:total], buffers.seq_lens[:num_reqs]
    if stable_metadata:
        slot_mapping, seq_lens_t, query_start_loc = slot_mapping.clone(), seq_lens_t.clone(), query_start_loc.clone()
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=_group_table(batch.block_table[:num_reqs], 0, num_groups, max_blocks).to(device),
        seq_lens=seq_lens_t.to(device),
        query_start_loc=query_start_loc.to(device),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
    )
    if num_groups > 1:
        offsets = positions % block_size
        metadata = _with_groups(metadata, batch, row_of_token, block_idx, offsets, block_size, max_blocks, device)
    input_ids = buffers.input_ids[:total].to(device).unsqueeze(0)
    return input_ids, buffers.positions[:total].to(device).unsqueeze(0), metadata


def _group_table(table: np.ndarray, group: int, num_groups: int, width: int) -> torch.Tensor:
    """Group ``group``'s block table out of the rows' interleaved ones (``width`` interleaved columns)."""
    return torch.from_numpy(np.ascontiguousarray(table[:, group:width:num_groups]))


def _with_groups(
    metadata: AttentionMetadata,
    batch: InputBatch,
    row_of_token: np.ndarray,
    block_idx: np.ndarray,
    offsets: np.ndarray,
    block_size: int,
    width: int,
    device: torch.device,
) -> AttentionMetadata:
    """``metadata`` (group 0's) with every KV-cache group's own slot mapping and block tables in ``groups``
    (``block_idx``: each token's column of group 0 in the interleaved tables)."""
    num_groups = width // -(-metadata.max_seq_len // block_size)
    table = batch.block_table[: metadata.seq_lens.shape[0]]
    groups = [metadata]
    for group in range(1, num_groups):
        slots = batch.block_table[row_of_token, block_idx + group].astype(np.int64) * block_size + offsets
        groups.append(
            dataclasses.replace(
                metadata,
                slot_mapping=torch.from_numpy(slots).to(device),
                block_tables=_group_table(table, group, num_groups, width).to(device),
            )
        )
    return dataclasses.replace(metadata, groups=tuple(groups))
