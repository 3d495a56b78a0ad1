"""Applying one step's model output: draft rollback, sampled tokens with stop checks, finished requests leaving
the scheduler, and the ``EngineCoreOutputs`` per client. Plain functions behind ``Scheduler.update_from_output``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllite.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason, LogprobsLists, SchedulerStats
from vllite.request import Request, RequestStatus
from vllite.sched.routed_experts import record_routing, take_routing
from vllite.sched.sessions import continue_session, keeps_session_open
from vllite.sched.stop import check_stop
from vllite.structured_output.bitmask import resolve_grammar_output
from vllite.structured_output.manager import advance_grammar

_NOTHING: frozenset[str] = frozenset()

if TYPE_CHECKING:
    from vllite.sched.output import ModelRunnerOutput, SchedulerOutput
    from vllite.sched.scheduler import Scheduler


def update_from_output(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
) -> dict[int, EngineCoreOutputs]:
    """``Scheduler.update_from_output``: applies the sampled tokens of every scheduled request still alive, moves
    stopped requests out of the running (or waiting) list and frees them before their last output is built."""
    recomputing = _apply_step_reports(scheduler, scheduler_output, model_runner_output)
    outputs = _apply_sampled_to_scheduled(scheduler, scheduler_output, model_runner_output, recomputing)
    for request in (*scheduler.failed_requests, *scheduler.closed_sessions):
        outputs[request.client_index].append(make_finish_output(request))
    scheduler.failed_requests, scheduler.closed_sessions = [], []
    if model_runner_output.draft_token_ids:
        scheduler.update_draft_token_ids(model_runner_output.draft_token_ids)
    engine_core_outputs = group_by_client(outputs, scheduler.finished_req_ids_dict, scheduler.make_stats())
    scheduler.finished_req_ids_dict = defaultdict(set)
    return engine_core_outputs


def _apply_step_reports(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
) -> frozenset[str] | set[str]:
    """Applies what the step reports besides sampled tokens, before any token is: KV transfers (freed blocks,
    finished and failed loads), draft acceptance figures, and grammars that raised (their requests are failed,
    through ``fail_after_step``). Returns the ids of the requests recomputing after a failed KV load, whose
    tokens are not trusted."""
    recomputing: frozenset[str] | set[str] = _NOTHING
    if scheduler.kv_transfer is not None:
        recomputing = scheduler.kv_transfer.update_from_output(scheduler, model_runner_output.kv_connector_output)
    if scheduler.spec_decoding is not None and scheduler_output.scheduled_spec_decode_tokens:
        scheduler.spec_decoding.observe(scheduler_output, model_runner_output)
    grammar_output = resolve_grammar_output(scheduler_output.grammar_output)  # the fill is done with the matchers
    if grammar_output is not None and grammar_output.failed:
        scheduler.fail_after_step.update(grammar_output.failed)  # a grammar that raised ends its request alone
    return recomputing


def _apply_sampled_to_scheduled(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    model_runner_output: ModelRunnerOutput,
    recomputing: frozenset[str] | set[str],
) -> defaultdict[int, list[EngineCoreOutput]]:
    """Applies the sampled tokens (or the error) of every scheduled request still alive and not ``recomputing``;
    the requests that stopped leave the running (or waiting) list and are freed before their last output is
    built; a session whose turn ended is not freed but continues (``vllite.sched.sessions``). Returns the
    requests' outputs per client index."""
    outputs: defaultdict[int, list[EngineCoreOutput]] = defaultdict(list)
    stopped_running: set[Request] = set()
    stopped_waiting: list[Request] = []
    turns_ended: list[Request] = []
    row_starts = logprob_row_starts(model_runner_output)
    max_model_len = scheduler.max_model_len
    failed = model_runner_output.failed_requests or {}
    fail_after_step = scheduler.fail_after_step
    index_of, sampled = model_runner_output.req_id_to_index, model_runner_output.sampled_token_ids
    no_drafts = not scheduler_output.scheduled_spec_decode_tokens
    pooled = model_runner_output.pooler_output
    routed = model_runner_output.routed_experts
    requests = scheduler.requests
    for request_id in scheduler_output.num_scheduled_tokens:
        request = requests.get(request_id)
        if request is None or request.is_finished() or request_id in recomputing:
            continue  # finished (aborted) while the model ran, or recomputing after a failed KV load
        was_running = request.status == RequestStatus.RUNNING
        if (failed or fail_after_step) and _fail_if_reported(request, failed, fail_after_step):
            new_token_ids: list[int] = []  # a plugin failed for it: its tokens are not trusted
        elif no_drafts:  # the common case, inlined: at most one sampled token
            index = index_of.get(request_id)
            new_token_ids = sampled[index] if index is not None else []
            if len(new_token_ids) == 1:
                request.append_output_token_ids(new_token_ids[0])
                check_stop(request, max_model_len)
            elif new_token_ids:
                new_token_ids = append_output_tokens(request, new_token_ids, max_model_len)
        else:
            new_token_ids = apply_sampled_tokens(request, scheduler_output, model_runner_output, max_model_len)
        if new_token_ids and request.structured_output_request is not None:
            advance_grammar(request, new_token_ids)  # a terminated grammar finishes the request (stop)
        if pooled is not None and request_id in pooled and not request.is_finished():
            request.status = RequestStatus.FINISHED_STOPPED  # a pooling request ends with its pooled output
        stopped = request.is_finished()
        session_open = False
        if stopped:
            stopped_lists = (stopped_running, stopped_waiting, turns_ended)
            session_open = _retire_stopped(scheduler, request, was_running, *stopped_lists)
        if routed is not None and request_id in routed:
            record_routing(request, *routed[request_id])
        output = make_request_output(request, new_token_ids, stopped, model_runner_output, row_starts)
        if output is not None:
            if stopped:
                _attach_results(output, request, model_runner_output, session_open)
            outputs[request.client_index].append(output)
    _remove_stopped(scheduler, stopped_running, stopped_waiting)
    for request in turns_ended:
        continue_session(scheduler, request)
    return outputs


def _attach_results(
    output: EngineCoreOutput, request: Request, model_runner_output: ModelRunnerOutput, session_open: bool
) -> None:
    """What a stopped request's last output carries besides its tokens: a pooling request's result, whether the
    session stays open, and (``--enable-return-routed-experts``) the experts every position was routed to."""
    output.session_open = session_open
    if model_runner_output.pooler_output is not None:
        output.pooling_output = model_runner_output.pooler_output.get(request.request_id)
    if model_runner_output.routed_experts is not None and not session_open:
        output.routed_experts = take_routing(request)


def _retire_stopped(
    scheduler: Scheduler,
    request: Request,
    was_running: bool,
    stopped_running: set[Request],
    stopped_waiting: list[Request],
    turns_ended: list[Request],
) -> bool:
    """Notes a stopped request for removal from its queue and frees it, unless it is a session whose turn ended
    (it continues: True)."""
    if was_running:
        stopped_running.add(request)
    else:
        stopped_waiting.append(request)
    if keeps_session_open(request, scheduler.max_model_len):
        turns_ended.append(request)
        return True
    scheduler._free_request(request)
    return False


def _fail_if_reported(request: Request, failed: Mapping[str, str], fail_after_step: dict[str, str]) -> bool:
    """Finishes ``request`` with ERROR when a plugin failed for it: the model runner reported it in this step's
    ``failed_requests``, else a hook failed after it was admitted (its ``fail_after_step`` entry is consumed)."""
    error = failed.get(request.request_id) or fail_after_step.pop(request.request_id, None)
    if error is None:
        return False
    request.status = RequestStatus.FINISHED_ERROR
    request.error = error
    return True


def _remove_stopped(scheduler: Scheduler, stopped_running: set[Request], stopped_waiting: list[Request]) -> None:
    """Takes the requests that stopped this step (already freed) out of the running list and the waiting queue,
    keeping the order of the others."""
    if stopped_running:
        scheduler.running[:] = [r for r in scheduler.running if r not in stopped_running]
    if stopped_waiting:
        scheduler.waiting.remove_requests(stopped_waiting)


def make_finish_output(request: Request) -> EngineCoreOutput:
    """The finish output of a request that ended outside the model's output: failed during ``schedule()``, or a
    session whose input ended while it was parked."""
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=request.get_finished_reason() or FinishReason.ERROR,
        events=request.take_events(),
        num_cached_tokens=max(request.num_cached_tokens, 0),
        error=request.error,
        kv_transfer_params=request.kv_transfer_params,
    )


def apply_sampled_tokens(
    request: Request, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput, max_model_len: int
) -> list[int]:
    """Rolls rejected draft tokens back from ``num_computed_tokens`` (D drafts, G sampled tokens → D - (G - 1)
    rejected) and appends the sampled tokens one at a time with a stop check after each; returns the tokens
    kept (those after a stop are dropped). A stopped request has its finished status set."""
    index = model_runner_output.req_id_to_index.get(request.request_id)
    generated = model_runner_output.sampled_token_ids[index] if index is not None else []
    if not generated:
        return generated
    drafts = scheduler_output.scheduled_spec_decode_tokens.get(request.request_id)
    if drafts:
        num_rejected = len(drafts) - (len(generated) - 1)
        if num_rejected > 0 and request.num_computed_tokens > 0:
            request.num_computed_tokens -= num_rejected
    return append_output_tokens(request, generated, max_model_len)


def append_output_tokens(request: Request, token_ids: list[int], max_model_len: int) -> list[int]:
    """Appends tokens one by one, stopping at the first that finishes the request; returns the tokens kept."""
    if len(token_ids) == 1:
        request.append_output_token_ids(token_ids[0])
        check_stop(request, max_model_len)
        return token_ids
    for num_kept, token_id in enumerate(token_ids, 1):
        request.append_output_token_ids(token_id)
        if check_stop(request, max_model_len):
            return token_ids[:num_kept]
    return token_ids


def make_request_output(
    request: Request,
    new_token_ids: list[int],
    stopped: bool,
    model_runner_output: ModelRunnerOutput,
    row_starts: list[int] | None,
) -> EngineCoreOutput | None:
    """The request's output for this step; ``None`` when there is nothing to report (a prefill chunk that
    sampled nothing and has no prompt logprobs)."""
    request_id = request.request_id
    prompt_logprobs = model_runner_output.prompt_logprobs_dict.get(request_id)
    if not (new_token_ids or stopped or prompt_logprobs is not None):
        return None
    new_logprobs = None
    if row_starts is not None and new_token_ids and request.sampling_params.logprobs is not None:
        start = row_starts[model_runner_output.req_id_to_index[request_id]]
        new_logprobs = _slice_logprobs(model_runner_output.logprobs, start, start + len(new_token_ids))
    nans = model_runner_output.num_nans_in_logits
    return EngineCoreOutput(
        request_id=request_id,
        new_token_ids=new_token_ids,
        new_logprobs=new_logprobs,
        new_prompt_logprobs_tensors=prompt_logprobs,
        finish_reason=request.get_finished_reason() if stopped else None,
        stop_reason=request.stop_reason,
        events=request.take_events(),
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_nans_in_logits=nans.get(request_id, 0) if nans else 0,
        error=request.error if stopped else None,
        kv_transfer_params=request.kv_transfer_params if stopped else None,
    )


def group_by_client(
    outputs: Mapping[int, list[EngineCoreOutput]],
    finished_req_ids: Mapping[int, set[str]],
    stats: SchedulerStats | None,
) -> dict[int, EngineCoreOutputs]:
    """One ``EngineCoreOutputs`` per client with outputs or finished ids; the stats ride on the first one."""
    engine_core_outputs = {client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()}
    for client, finished in finished_req_ids.items():
        if finished:
            eco = engine_core_outputs.get(client)
            if eco is None:
                eco = engine_core_outputs[client] = EngineCoreOutputs()
            eco.finished_requests = finished
    if stats is not None:
        eco = next(iter(engine_core_outputs.values()), None)
        if eco is None:
            eco = engine_core_outputs[0] = EngineCoreOutputs()
        eco.scheduler_stats = stats
    return engine_core_outputs


def logprob_row_starts(output: ModelRunnerOutput) -> list[int] | None:
    """The first logprobs row of each request (rows are the sampled tokens of all requests, in order), or
    ``None`` without logprobs."""
    if output.logprobs is None:
        return None
    starts: list[int] = []
    row = 0
    for token_ids in output.sampled_token_ids:
        starts.append(row)
        row += len(token_ids)
    return starts


def _slice_logprobs(logprobs: Any, start: int, end: int) -> LogprobsLists:
    return LogprobsLists(
        logprob_token_ids=logprobs.logprob_token_ids[start:end],
        logprobs=logprobs.logprobs[start:end],
        sampled_token_ranks=logprobs.sampled_token_ranks[start:end],
    )
