"""``process_dict_updates``: the standard way to keep sparse per-request state in step with the batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from vllite.logits_processor.interface import BatchUpdate, MoveDirectionality

if TYPE_CHECKING:
    from vllite.sampling_params import SamplingParams

T = TypeVar("T")

NewState = Callable[["SamplingParams", "list[int] | None", "list[int]"], "T | None"]


def process_dict_updates(req_entries: dict[int, T], batch_update: BatchUpdate | None, new_state: NewState) -> bool:
    """Applies ``batch_update`` to ``req_entries`` (batch index -> state); returns whether anything changed.

    ``new_state(params, prompt_ids, output_ids)`` builds a request's state, or returns ``None`` when the
    request does not use the processor (any stale state at its index is then dropped). Added requests are
    processed first, then removals, then moves; a move pops both ends before re-inserting, so a SWAP
    exchanges states and a UNIDIRECTIONAL move leaves the source empty and discards the destination's old
    state. The return value tells the caller whether its derived tensors must be rebuilt.
    """
    if not batch_update:
        return False
    updated = False
    for index, params, prompt_tok_ids, output_tok_ids in batch_update.added:
        state = new_state(params, prompt_tok_ids, output_tok_ids)
        if state is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:
            updated = True
    if req_entries:
        for index in batch_update.removed:
            if req_entries.pop(index, None) is not None:
                updated = True
        for a_index, b_index, direct in batch_update.moved:
            a_entry = req_entries.pop(a_index, None)
            b_entry = req_entries.pop(b_index, None)
            if a_entry is not None:
                req_entries[b_index] = a_entry
                updated = True
            if b_entry is not None:
                updated = True
                if direct == MoveDirectionality.SWAP:
                    req_entries[a_index] = b_entry
    return updated
