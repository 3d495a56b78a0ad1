"""Building ``CachedRequestData``: what changed since the workers last saw each running request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllite.sched.output import CachedRequestData

if TYPE_CHECKING:
    from vllite.sched.step_state import StepState


def make_cached_request_data(step: StepState, prev_step_scheduled_req_ids: set[str]) -> CachedRequestData:
    """The diff for the running requests scheduled in ``step``, which the workers already hold: new blocks
    (``None`` if none), the pre-step computed count, the non-draft tokens scheduled now, output counts, and all
    tokens only for requests that were not scheduled in the previous step."""
    num_scheduled_tokens, spec_tokens = step.num_scheduled_tokens, step.spec_tokens
    data = CachedRequestData()
    prev = prev_step_scheduled_req_ids
    add_id, add_tokens = data.req_ids.append, data.new_token_ids.append
    add_blocks, add_computed = data.new_block_ids.append, data.num_computed_tokens.append
    add_outputs, all_token_ids = data.num_output_tokens.append, data.all_token_ids
    for request in step.running:
        request_id = request.request_id
        computed = request.num_computed_tokens
        num_tokens = num_scheduled_tokens[request_id]
        if spec_tokens:
            num_tokens -= len(spec_tokens.get(request_id, ()))
        new_blocks = step.new_blocks[request_id]
        tokens = request.all_token_ids
        add_id(request_id)
        add_tokens(tokens[computed : computed + num_tokens])
        add_blocks(new_blocks.get_block_ids() if new_blocks.blocks else None)
        add_computed(computed)
        add_outputs(request.num_output_tokens + request.num_output_placeholders)  # the workers know in-flight ones
        if request_id not in prev:
            all_token_ids[request_id] = list(tokens)
    return data
