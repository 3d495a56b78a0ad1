"""Scheduler test support: a small ``EngineConfig``, hashed requests, and :class:`ScriptedModelRunner`, which turns
each ``SchedulerOutput`` into the ``ModelRunnerOutput`` a real model runner would return, with tokens chosen by the
test. Drives a scheduler without a model, an executor or torch::

    from vllite.sched import Scheduler
    from vllite.testing import ScriptedModelRunner, make_config, make_request

    scheduler = Scheduler(make_config())
    runner = ScriptedModelRunner()
    scheduler.add_request(make_request(scheduler, "r0", [1, 2, 3], max_tokens=4))
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner.execute(output))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from vllite.request import Request
from vllite.sched.output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from vllite.config import EngineConfig

# (request_id, position of the token to sample) -> token id
TokenChooser = Callable[[str, int], int]


def _default_chooser(request_id: str, position: int) -> int:
    return 1000 + position


class ScriptedModelRunner:
    """A model-free stand-in for a model runner (not an :class:`~vllite.executor.Executor`): tracks each request's
    token count the way a worker does and "samples" the tokens the test chose.

    ``choose`` is a ``(request_id, position) -> token`` function or a ``{request_id: [tokens...]}`` script
    (afterwards, and by default, token ``1000 + position``).

    A request samples only when this step's tokens reach the end of its known tokens (a prefill chunk that
    stops short samples nothing). With drafts scheduled, ``accept(request_id, drafts)`` decides how many are
    accepted (default: all); the sampled list is the accepted drafts plus one bonus token.
    """

    def __init__(
        self,
        choose: TokenChooser | Mapping[str, list[int]] | None = None,
        accept: Callable[[str, list[int]], int] | None = None,
    ) -> None:
        if choose is None:
            self._choose: TokenChooser = _default_chooser
        elif callable(choose):
            self._choose = choose
        else:
            scripted = {rid: list(tokens) for rid, tokens in choose.items()}
            self._choose = lambda rid, pos: scripted[rid].pop(0) if scripted.get(rid) else 1000 + pos
        self._accept = accept
        self.num_tokens: dict[str, int] = {}  # the worker's view: prompt + outputs known
        self.num_prompt_tokens: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step; mirrors the worker's bookkeeping of new, resumed, running, finished and preempted requests."""
        for request_id in so.finished_req_ids | so.preempted_req_ids:
            self.num_tokens.pop(request_id, None)
            self.num_prompt_tokens.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.num_prompt_tokens[new.req_id] = len(new.prompt_token_ids)
        cached = so.scheduled_cached_reqs
        # Outputs the scheduler dropped (e.g. tokens sampled on top of a failed KV load) are dropped here too.
        for request_id, num_outputs in zip(cached.req_ids, cached.num_output_tokens):
            num_prompt = self.num_prompt_tokens.get(request_id)
            if num_prompt is not None and num_prompt + num_outputs < self.num_tokens[request_id]:
                self.num_tokens[request_id] = num_prompt + num_outputs
        computed_by_id = dict(zip(cached.req_ids, cached.num_computed_tokens))
        computed_by_id.update({new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs})
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for request_id, num_scheduled in so.num_scheduled_tokens.items():
            drafts = so.scheduled_spec_decode_tokens.get(request_id, [])
            end = computed_by_id[request_id] + num_scheduled - len(drafts)
            known = self.num_tokens[request_id]
            tokens: list[int] = []
            if end >= known:
                num_accepted = len(drafts) if self._accept is None else self._accept(request_id, drafts)
                tokens = list(drafts[:num_accepted])
                tokens.append(self._choose(request_id, known + len(tokens)))
                self.num_tokens[request_id] = known + len(tokens)
            req_ids.append(request_id)
            sampled.append(tokens)
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)}, sampled_token_ids=sampled
        )


def make_model_runner_output(so: SchedulerOutput, tokens: Mapping[str, list[int]] | None = None) -> ModelRunnerOutput:
    """A one-off ``ModelRunnerOutput``: ``tokens[request_id]`` for the requests given, nothing for the others."""
    tokens = tokens or {}
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[list(tokens.get(rid, [])) for rid in req_ids],
    )


def make_config(
    *,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    block_size: int = 4,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    enable_prefix_caching: bool = True,
    num_lookahead_tokens: int = 0,
    scheduler_cls: str | None = None,
    scheduling_policy: str = "fcfs",
    policy_args: dict[str, Any] | None = None,
    tool_call_estimator: str = "utility",
    scheduler_reserve_full_isl: bool = True,
    watermark: float = 0.0,
) -> EngineConfig:
    """A small ``EngineConfig`` for scheduler tests, with the limits an engine would have settled on."""
    from vllite.config import CacheConfig, EngineConfig, SchedulerConfig

    config = EngineConfig(
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            num_lookahead_tokens=num_lookahead_tokens,
            scheduler_cls=scheduler_cls,
            scheduling_policy=scheduling_policy,
            policy_args=dict(policy_args or {}),
            tool_call_estimator=tool_call_estimator,
            scheduler_reserve_full_isl=scheduler_reserve_full_isl,
            watermark=watermark,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
    )
    return config.with_limits(max_model_len)


def make_request(
    scheduler: Any,
    request_id: str,
    prompt_token_ids: list[int],
    *,
    eos_token_id: int | None = None,
    priority: int = 0,
    arrival_time: float = 0.0,
    client_index: int = 0,
    **sampling: Any,
) -> Request:
    """A ``Request`` hashed with ``scheduler.block_hasher``; ``sampling`` goes to ``SamplingParams``."""
    from vllite.sampling_params import SamplingParams

    return Request(
        request_id,
        prompt_token_ids,
        SamplingParams(**sampling),
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
        client_index=client_index,
        block_hasher=scheduler.block_hasher,
    )
