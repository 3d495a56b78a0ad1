"""Prompt logprobs, chunk by chunk.

For a request that asks for ``prompt_logprobs``, each prefill chunk returns a ``LogprobsTensors`` over the prompt
positions ``p`` of the chunk that predict prompt token ``p + 1`` (the first prompt token has no logprob; the last
prompt position predicts the first *output* token, so it is not a prompt logprob). Columns are
``[prompt token, top-1 .. top-N]``, logprobs are the raw model ``log_softmax``. A request recomputing its prompt
after preemption never returns a position twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from vllite.plugins.transformers_executor.input_batch import CachedRequestState
from vllite.plugins.transformers_executor.sampler import gather_logprobs
from vllite.protocol import LogprobsTensors


@dataclass
class PromptLogprobsChunk:
    """Packed-token range ``[lo, hi)`` whose logits give the logprobs of prompt positions ``first ..``."""

    req_id: str
    lo: int
    hi: int
    first: int
    num_logprobs: int


def plan_prompt_logprobs(
    requests: Mapping[str, CachedRequestState],
    req_ids: list[str],
    num_scheduled: list[int],
    query_start_loc: list[int],
    vocab_size: int,
) -> list[PromptLogprobsChunk]:
    """The chunks of this step that produce prompt logprobs, in request order."""
    plan = []
    for row, req_id in enumerate(req_ids):
        state = requests[req_id]
        wanted = state.sampling_params.prompt_logprobs
        if wanted is None:
            continue
        start = state.num_computed_tokens
        first = max(start, state.num_prompt_logprobs_done)
        last = min(start + num_scheduled[row], state.num_prompt_tokens - 1)
        if first < last:
            lo = query_start_loc[row] + first - start
            plan.append(
                PromptLogprobsChunk(req_id, lo, lo + last - first, first, vocab_size if wanted == -1 else wanted)
            )
    return plan


def compute_prompt_logprobs(
    plan: list[PromptLogprobsChunk], logits: torch.Tensor, requests: Mapping[str, CachedRequestState]
) -> dict[str, LogprobsTensors]:
    """``req_id -> LogprobsTensors`` (on the CPU) from ``logits``, whose rows are the planned ranges back to
    back; marks the positions as returned."""
    result: dict[str, LogprobsTensors] = {}
    offset = 0
    for chunk in plan:
        count = chunk.hi - chunk.lo
        rows = torch.log_softmax(logits[offset : offset + count].float(), dim=-1)
        offset += count
        state = requests[chunk.req_id]
        targets = state.prompt_token_ids[chunk.first + 1 : chunk.first + 1 + count]
        t = gather_logprobs(rows, chunk.num_logprobs, torch.tensor(targets, device=rows.device))
        result[chunk.req_id] = LogprobsTensors(
            t.logprob_token_ids.cpu(), t.logprobs.cpu(), t.selected_token_ranks.cpu()
        )
        state.num_prompt_logprobs_done = chunk.first + count
    return result
