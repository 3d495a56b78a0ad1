"""``GrammarOutput`` (a step's token bitmask for its constrained requests) and applying it to logits.

The manager fills the bitmask on a worker thread while the model runs; the step's ``SchedulerOutput`` carries a
future of it (``grammar_output``), which the executor resolves right before sampling. Rows: each constrained request
that samples this step has ``1 + len(drafts)`` consecutive rows from ``req_id_to_row[req_id]`` (row ``k`` constrains
the token after the ``k``-th draft); a request without drafts has one.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class GrammarOutput:
    """One step's grammar constraints (vLLM's ``GrammarOutput``): ``structured_output_request_ids`` in row order,
    ``grammar_bitmask`` ``[rows, ceil(vocab / 32)]`` int32 on the CPU, and each request's first row."""

    structured_output_request_ids: list[str]
    grammar_bitmask: torch.Tensor
    req_id_to_row: dict[str, int]


def resolve_grammar_output(value: GrammarOutput | Future | None) -> GrammarOutput | None:
    """The step's ``GrammarOutput`` (waiting for the fill thread when it is still running)."""
    if isinstance(value, Future):
        return value.result()
    return value


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` bool, True where the bitmask forbids the token (numpy's ``unpackbits`` over the words'
    little-endian bytes: bit ``i`` of word ``j`` is token ``32 * j + i``)."""
    import numpy as np
    import torch

    words = bitmask.numpy().astype("<i4", copy=False)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    banned = torch.from_numpy(bits == 0)
    if banned.shape[1] < vocab_size:  # a bitmask narrower than the logits forbids the rest
        pad = torch.ones(banned.shape[0], vocab_size - banned.shape[1], dtype=torch.bool)
        banned = torch.cat([banned, pad], dim=1)
    return banned


@dataclass
class BatchBitmask:
    """A grammar bitmask lined up with a batch's logits: row ``i`` constrains logits row ``i``, for the ``rows``
    listed (the constrained requests'); :meth:`apply_` sets the tokens it forbids to ``-inf`` in place, without
    unpacking it to a boolean mask first."""

    bitmask: torch.Tensor  # [batch, ceil(vocab / 32)] int32, on the logits' device
    rows: list[int]

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """Masks ``logits`` ``[batch, vocab]`` in place (xgrammar's kernel: C++ on the CPU, CUDA on a GPU)."""
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, self.bitmask, indices=self.rows)
        return logits


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor | BatchBitmask) -> torch.Tensor:
    """``logits`` with the grammar's forbidden tokens at ``-inf``: a ``BatchBitmask`` in place, a boolean mask
    (True = banned, the speculative path's) into a new tensor."""
    if isinstance(mask, BatchBitmask):
        return mask.apply_(logits)
    return logits.masked_fill(mask, float("-inf"))


def batch_token_mask(
    grammar_output: GrammarOutput | Future | None, req_ids: list[str], vocab_size: int, device: torch.device
) -> BatchBitmask | None:
    """The grammar bitmask of a batch of one sampled token per request (``vocab_size``: the logits' width), or
    ``None`` when no request of the batch is constrained."""
    import torch

    output = resolve_grammar_output(grammar_output)
    if output is None:
        return None
    to_row = output.req_id_to_row
    batch_rows = [i for i, req_id in enumerate(req_ids) if req_id in to_row]
    if not batch_rows:
        return None
    source = output.grammar_bitmask
    # Words past the bitmask's width (logits wider than the grammar's vocabulary) stay 0: those tokens are banned.
    aligned = torch.zeros(len(req_ids), (vocab_size + 31) // 32, dtype=torch.int32)
    width = min(aligned.shape[1], source.shape[1])
    if len(batch_rows) == len(req_ids) and all(to_row[req_id] == i for i, req_id in enumerate(req_ids)):
        aligned[:, :width] = source[: len(req_ids), :width]  # the usual case: the fill used the batch's order
    else:
        source_rows = torch.tensor([to_row[req_ids[i]] for i in batch_rows], dtype=torch.int64)
        aligned[torch.tensor(batch_rows, dtype=torch.int64), :width] = source[source_rows, :width]
    return BatchBitmask(aligned.to(device), batch_rows)


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
