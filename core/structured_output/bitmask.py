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
    """``[rows, vocab_size]`` bool, True where the bitmask forbids the token."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab_size]
    if allowed.shape[1] < vocab_size:  # a bitmask narrower than the logits forbids the rest
        pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=allowed.dtype)
        allowed = torch.cat([allowed, pad], dim=1)
    return allowed == 0


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
    batch_rows = [i for i, req_id in enumerate(req_ids) if req_id in to_row]
    if not batch_rows:
        return None
    source_rows = torch.tensor([to_row[req_ids[i]] for i in batch_rows], dtype=torch.int64)
    mask = torch.zeros(len(req_ids), vocab_size, dtype=torch.bool)
    mask[torch.tensor(batch_rows, dtype=torch.int64)] = unpack_bitmask(output.grammar_bitmask[source_rows], vocab_size)
    return mask.to(device)
