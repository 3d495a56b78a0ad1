"""Building ``CachedRequestData``: what changed since the workers last saw each running request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllite.sched.output import CachedRequestData

if TYPE_CHECKING:
    from vllite.kv_cache import KVCacheBlocks
    from vllite.request import Request


def make_cached_request_data(
    scheduled_running: list[Request],
    num_scheduled_tokens: dict[str, int],
    spec_tokens: dict[str, list[int]],
    req_to_new_blocks: dict[str, KVCacheBlocks],
    prev_step_scheduled_req_ids: set[str],
) -> CachedRequestData:
    """The diff for requests the workers already hold: new blocks (``None`` if none), the pre-step computed
    count, the non-draft tokens scheduled now, output counts, and all tokens only for requests that were not
    scheduled in the previous step."""
    data = CachedRequestData()
    prev = prev_step_scheduled_req_ids
    add_id, add_tokens = data.req_ids.append, data.new_token_ids.append
    add_blocks, add_computed = data.new_block_ids.append, data.num_computed_tokens.append
    add_outputs, all_token_ids = data.num_output_tokens.append, data.all_token_ids
    for request in scheduled_running:
        request_id = request.request_id
        computed = request.num_computed_tokens
        num_tokens = num_scheduled_tokens[request_id]
        if spec_tokens:
            num_tokens -= len(spec_tokens.get(request_id, ()))
        new_blocks = req_to_new_blocks[request_id]
        tokens = request.all_token_ids
        add_id(request_id)
        add_tokens(tokens[computed : computed + num_tokens])
        add_blocks(new_blocks.get_block_ids() if new_blocks.blocks else None)
        add_computed(computed)
        add_outputs(request.num_output_tokens)
        if request_id not in prev:
            all_token_ids[request_id] = list(tokens)
    return data
