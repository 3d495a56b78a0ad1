"""``GrammarOutput`` (a step's token bitmask for its constrained requests) and applying it to logits.

The manager fills the bitmask on a worker thread while the model runs; the step's ``SchedulerOutput`` carries a
future of it (``grammar_output``), which the executor resolves right before sampling. Rows: each constrained request
that samples this step has ``1 + len(drafts)`` consecutive rows from ``req_id_to_row[req_id]`` (row ``k`` constrains
the token after the ``k``-th draft); a request without drafts has one.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class GrammarOutput:
    """One step's grammar constraints (vLLM's ``GrammarOutput``): ``structured_output_request_ids`` in row order,
    ``grammar_bitmask`` ``[rows, ceil(vocab / 32)]`` int32 on the CPU, each request's first row, and the requests
    whose grammar failed to fill."""

    structured_output_request_ids: list[str]
    grammar_bitmask: torch.Tensor
    req_id_to_row: dict[str, int]
    #: Requests whose grammar raised while filling (request id -> message): their rows allow every token, and
    #: ``update_from_output`` ends them with ERROR instead of keeping the token.
    failed: dict[str, str] = field(default_factory=dict)


def resolve_grammar_output(value: GrammarOutput | Future | None) -> GrammarOutput | None:
    """The step's ``GrammarOutput`` (waiting for the fill thread when it is still running)."""
    if isinstance(value, Future):
        return value.result()
    return value


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` bool, True where the bitmask forbids the token (numpy's ``unpackbits`` over the
    inverted words' little-endian bytes: bit ``i`` of word ``j`` is token ``32 * j + i``). Inverting the 32x smaller
    words first, then reading the unpacked bytes as bools, costs 0.06 ms for 256 rows of 4,096 tokens where
    comparing the unpacked bits with 0 costs 0.8 ms."""
    import numpy as np
    import torch

    words = bitmask.numpy().astype("<i4", copy=False)
    bits = np.unpackbits(np.invert(words).view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    banned = torch.from_numpy(bits.view(np.bool_))
    if banned.shape[1] < vocab_size:  # a bitmask narrower than the logits forbids the rest
        pad = torch.ones(banned.shape[0], vocab_size - banned.shape[1], dtype=torch.bool)
        banned = torch.cat([banned, pad], dim=1)
    return banned


def batch_token_mask(
    grammar_output: GrammarOutput | Future | None, req_ids: list[str], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """The banned-token mask ``[len(req_ids), vocab_size]`` (True = banned) for a batch of one sampled token per
    request, or ``None`` when no request of the batch is constrained."""
    import torch

    output = resolve_grammar_output(grammar_output)
    if output is None:
        return None
    to_row = output.req_id_to_row
    if output.structured_output_request_ids == req_ids and output.grammar_bitmask.shape[0] == len(req_ids):
        return unpack_bitmask(output.grammar_bitmask, vocab_size).to(device)  # every row constrained, in order
    batch_rows = [i for i, req_id in enumerate(req_ids) if req_id in to_row]
    if not batch_rows:
        return None
    source_rows = torch.tensor([to_row[req_ids[i]] for i in batch_rows], dtype=torch.int64)
    mask = torch.zeros(len(req_ids), vocab_size, dtype=torch.bool)
    mask[torch.tensor(batch_rows, dtype=torch.int64)] = unpack_bitmask(output.grammar_bitmask[source_rows], vocab_size)
    return mask.to(device)


def draft_token_mask(
    grammar_output: GrammarOutput | Future | None,
    req_ids: list[str],
    num_drafts: list[int],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The banned-token mask for a speculative step's kept logits rows: request ``i`` has ``1 + num_drafts[i]``
    consecutive rows (its positions after each draft), in request order; row ``p`` of a constrained request takes
    its bitmask row ``req_id_to_row + p``. ``None`` when no request of the batch is constrained."""
    import torch

    output = resolve_grammar_output(grammar_output)
    if output is None:
        return None
    to_row = output.req_id_to_row
    kept_rows: list[int] = []
    source_rows: list[int] = []
    first = 0
    for req_id, drafts in zip(req_ids, num_drafts, strict=True):
        start = to_row.get(req_id)
        if start is not None:
            kept_rows.extend(range(first, first + 1 + drafts))
            source_rows.extend(range(start, start + 1 + drafts))
        first += 1 + drafts
    if not kept_rows:
        return None
    mask = torch.zeros(first, vocab_size, dtype=torch.bool)
    source = output.grammar_bitmask[torch.tensor(source_rows, dtype=torch.int64)]
    mask[torch.tensor(kept_rows, dtype=torch.int64)] = unpack_bitmask(source, vocab_size)
    return mask.to(device)
