"""What the scheduler hands the executor each step, and what the executor hands back.

``SchedulerOutput`` carries full data only for requests the workers have not seen (``NewRequestData``) and
only the diff for the others (``CachedRequestData``); the executor keeps per-request state between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllite.kv_connector.base import KVConnectorOutput
    from vllite.lora import LoRARequest
    from vllite.pooling_params import PoolingParams
    from vllite.request import Request
    from vllite.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request scheduled for the first time (or resumed after preemption, when workers dropped it)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Output tokens so far: non-empty only when a preempted request is re-admitted.
    output_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None  # a request to a pooling model
    # An embeds prompt's float tensor [num_prompt_tokens, hidden_size] (prompt_token_ids are placeholders then).
    prompt_embeds: Any = None

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids),
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
            prompt_embeds=request.prompt_embeds,
        )


@dataclass
class CachedRequestData:
    """Requests the workers already know: only what changed since they last saw them.

    ``new_block_ids[i]`` is ``None`` when request ``i`` got no new blocks; new blocks extend the request's table
    (a preempted request comes back as ``NewRequestData`` instead). ``all_token_ids`` is sent only for requests
    that were not scheduled in the previous step (the workers may have missed tokens).
    """

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls()


@dataclass
class SchedulerOutput:
    """One step's schedule: which requests run, with how many tokens each, and their blocks."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None
    # Structured outputs: the step's grammar bitmask for its constrained requests that sample (a
    # vllite.structured_output.bitmask.GrammarOutput, or a Future of one filled while the model runs); None without.
    grammar_output: Any = None

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData.make_empty(), {}, 0)


@dataclass
class ModelRunnerOutput:
    """The executor's answer for one step.

    ``sampled_token_ids[i]`` are the tokens accepted for ``req_ids[i]`` this step: one token for a normal
    decode, up to ``1 + num_draft_tokens`` with speculative decoding, and an empty list for a prefill chunk
    that does not end the prompt. ``logprobs`` and ``prompt_logprobs_dict`` are ``vllite.protocol`` structs.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: Any = None  # LogprobsLists over all sampled tokens (rows in req order), or None
    prompt_logprobs_dict: dict[str, Any] = field(default_factory=dict)  # req_id -> LogprobsTensors | None
    num_nans_in_logits: dict[str, int] | None = None
    # Draft tokens proposed for the next step, per request (speculative decoding).
    draft_token_ids: dict[str, list[int]] | None = None
    # Requests a plugin failed for in this step (e.g. a logits processor raised on their rows): req_id -> the
    # message naming the plugin, the hook and the exception. Their sampled tokens are discarded; the scheduler
    # finishes them with ERROR.
    failed_requests: dict[str, str] | None = None
    # The KV connector's results of this step (finished transfers, failed loads); None without a connector.
    kv_connector_output: KVConnectorOutput | None = None
    # A pooling model's results: req_id -> the pooled tensor of each request whose prompt completed this step
    # (it finishes with it); None for a generating model.
    pooler_output: dict[str, Any] | None = None
    # --enable-return-routed-experts: req_id -> (start, rows): the expert ids of its positions from ``start`` on
    # that this step computed (or read from cached slots), [positions, moe_layers, top_k].
    routed_experts: dict[str, Any] | None = None

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls([], {}, [])
