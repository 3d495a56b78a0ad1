"""Output placeholders for async scheduling: how far a running request may be scheduled ahead of its outputs.

With ``--async-scheduling`` the scheduler plans step N+1 while step N runs. A request decoding in step N gets an
*output placeholder* (``Request.num_output_placeholders``) for the token step N will sample; its
``num_computed_tokens`` already counts that position, so step N+1 can schedule the next position before the token
is known. The executor runs steps in order and records each sampled token in its own persistent batch, so the
input token of that next position is known to it when step N+1 executes. The placeholder is filled (and the stop
conditions checked) when step N's output arrives; a request that stopped there drops step N+1's extra token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllite.request import Request


def num_new_tokens_ahead(request: Request, num_computed_tokens: int) -> int:
    """The tokens to schedule for a running ``request`` that still waits for ``num_output_placeholders`` sampled
    tokens: its next decode position, or 0 when it must wait for its outputs first.

    It waits when the tokens in flight already reach ``max_tokens`` (no request overshoots its length, whatever
    the in-flight tokens turn out to be) and when it has a grammar (structured outputs: the grammar must accept
    the in-flight token before the next step's bitmask can be built).
    """
    num_placeholders = request.num_output_placeholders
    if request.structured_output_request is not None:
        return 0
    if request.num_output_tokens + num_placeholders >= request.max_tokens:
        return 0
    return request.num_tokens_with_spec + num_placeholders - num_computed_tokens
