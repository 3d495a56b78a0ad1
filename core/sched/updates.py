"""The half of ``Scheduler`` that runs after the model: applying outputs, stop checks, drafts, and the engine's
queries (counts, pause state, stats, prefix-cache reset). Kept apart from ``schedule()`` for readability.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllite.protocol import EngineCoreOutput, EngineCoreOutputs, LogprobsLists, SchedulerStats
from vllite.request import Request, RequestStatus
from vllite.sched.interface import PauseState
from vllite.sched.stop import check_stop

if TYPE_CHECKING:
    from vllite.kv_cache import KVCacheManager
    from vllite.sched.output import ModelRunnerOutput, SchedulerOutput
    from vllite.sched.request_queue import RequestQueue


class OutputUpdateMixin:
    """``update_from_output`` and the engine-facing queries of :class:`vllite.sched.Scheduler`."""

    # Provided by Scheduler.
    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue
    kv_cache_manager: KVCacheManager
    max_model_len: int
    log_stats: bool
    clock: Callable[[], float]
    finished_req_ids: set[str]
    finished_req_ids_dict: dict[int, set[str]]
    prev_step_scheduled_req_ids: set[str]
    step_counter: int
    _pause_state: PauseState
    _num_preemptions_since_stats: int
    _preempted_between_steps: set[str]
    _free_request: Callable[[Request], None]
    _preempt_request: Callable[[Request, float], None]

    # ------------------------------------------------------------------ outputs
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Applies one step's sampled tokens and returns the outputs per client index.

        For each scheduled request still alive: rejected draft tokens are rolled back from
        ``num_computed_tokens`` (D drafts, G sampled tokens → D - (G - 1) rejected); sampled tokens are appended
        one at a time with a stop check after each (tokens after a stop are dropped); a finished request leaves
        the running list (or the waiting list, if it was preempted meanwhile) and its blocks go to
        ``on_request_finished``. Prefill chunks that sample nothing produce no output. Finished ids since the
        previous call are reported per client in ``finished_requests``; stats ride on one client's outputs.
        """
        sampled = model_runner_output.sampled_token_ids
        req_id_to_index = model_runner_output.req_id_to_index
        spec = scheduler_output.scheduled_spec_decode_tokens
        prompt_logprobs = model_runner_output.prompt_logprobs_dict
        nans = model_runner_output.num_nans_in_logits
        logprobs = model_runner_output.logprobs
        row_starts = _row_starts(model_runner_output) if logprobs is not None else None
        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        stopped_running: set[Request] = set()
        stopped_waiting: list[Request] = []
        requests = self.requests

        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(request_id)
            if request is None or request.is_finished():
                continue  # finished (aborted) while the model ran
            index = req_id_to_index.get(request_id)
            generated = sampled[index] if index is not None else []
            drafts = spec.get(request_id)
            if drafts and generated:
                num_rejected = len(drafts) - (len(generated) - 1)
                if num_rejected > 0 and request.num_computed_tokens > 0:
                    request.num_computed_tokens -= num_rejected
            new_token_ids = generated
            stopped = False
            if generated:
                was_running = request.status == RequestStatus.RUNNING
                new_token_ids, stopped = self._append_output_tokens(request, generated)
                if stopped:
                    if was_running:
                        stopped_running.add(request)
                    else:
                        stopped_waiting.append(request)
                    self._free_request(request)
            request_prompt_logprobs = prompt_logprobs.get(request_id)
            if not (new_token_ids or stopped or request_prompt_logprobs is not None):
                continue
            new_logprobs = None
            if row_starts is not None and new_token_ids and request.sampling_params.logprobs is not None:
                start = row_starts[index]  # type: ignore[index]
                new_logprobs = _slice_logprobs(logprobs, start, start + len(new_token_ids))
            outputs[request.client_index].append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    new_prompt_logprobs_tensors=request_prompt_logprobs,
                    finish_reason=request.get_finished_reason() if stopped else None,
                    stop_reason=request.stop_reason,
                    events=request.take_events(),
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    num_nans_in_logits=nans.get(request_id, 0) if nans else 0,
                )
            )

        if stopped_running:
            self.running[:] = [r for r in self.running if r not in stopped_running]
        if stopped_waiting:
            self.waiting.remove_requests(stopped_waiting)
        if model_runner_output.draft_token_ids:
            self.update_draft_token_ids(model_runner_output.draft_token_ids)

        engine_core_outputs = {client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()}
        for client, finished in self.finished_req_ids_dict.items():
            if finished:
                eco = engine_core_outputs.get(client)
                if eco is None:
                    eco = engine_core_outputs[client] = EngineCoreOutputs()
                eco.finished_requests = finished
        self.finished_req_ids_dict = defaultdict(set)
        stats = self.make_stats()
        if stats is not None:
            eco = next(iter(engine_core_outputs.values()), None)
            if eco is None:
                eco = engine_core_outputs[0] = EngineCoreOutputs()
            eco.scheduler_stats = stats
        return engine_core_outputs

    def _append_output_tokens(self, request: Request, token_ids: list[int]) -> tuple[list[int], bool]:
        """Appends tokens one by one, stopping at the first that finishes the request; returns the tokens kept."""
        max_model_len = self.max_model_len
        if len(token_ids) == 1:
            request.append_output_token_ids(token_ids[0])
            return token_ids, check_stop(request, max_model_len)
        for num_kept, token_id in enumerate(token_ids, 1):
            request.append_output_token_ids(token_id)
            if check_stop(request, max_model_len):
                return token_ids[:num_kept], True
        return token_ids, False

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Attaches the drafter's proposals to running requests that finished their prefill (others ignored);
        they are scheduled, within the budget, in the next step and verified by its output."""
        requests = self.requests
        for request_id, token_ids in draft_token_ids.items():
            request = requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING or request.is_prefill_chunk:
                continue
            request.spec_token_ids = list(token_ids)

    # ------------------------------------------------------------------ queries
    def get_num_unfinished_requests(self) -> int:
        """Waiting + running; only running under ``PAUSED_NEW``; 0 under ``PAUSED_ALL`` (so the engine idles)."""
        if self._pause_state == PauseState.PAUSED_ALL:
            return 0
        if self._pause_state == PauseState.PAUSED_NEW:
            return len(self.running)
        return len(self.waiting) + len(self.running)

    def has_finished_requests(self) -> bool:
        """Whether finished ids are still to be reported to the workers or the clients."""
        return bool(self.finished_req_ids) or any(self.finished_req_ids_dict.values())

    def get_request_counts(self) -> tuple[int, int]:
        """``(num_running, num_waiting)``."""
        return len(self.running), len(self.waiting)

    def get_kv_cache_usage(self) -> float:
        """The fraction of KV blocks in use."""
        return self.kv_cache_manager.usage

    @property
    def pause_state(self) -> PauseState:
        """The current pause state (see :class:`vllite.sched.PauseState`)."""
        return self._pause_state

    def set_pause_state(self, pause_state: PauseState) -> None:
        """Sets the pause state; the next ``schedule()`` honours it."""
        self._pause_state = PauseState(pause_state)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets every cached block hash. Fails (False) while requests hold blocks, unless
        ``reset_running_requests``: then every running request is preempted first (reported in the next
        ``SchedulerOutput.preempted_req_ids``) and a failure raises ``RuntimeError``."""
        if reset_running_requests:
            now = self.clock()
            while self.running:
                request = self.running.pop()
                self._preempt_request(request, now)
                self._preempted_between_steps.add(request.request_id)
            self.prev_step_scheduled_req_ids = set()
        ok = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not ok:
            raise RuntimeError("Could not reset the prefix cache although every running request was preempted.")
        return ok

    def make_stats(self) -> SchedulerStats | None:
        """Running / waiting counts, KV usage, prefix-cache queries and hits and preemptions since the previous
        call; ``None`` unless stats are on."""
        if not self.log_stats:
            return None
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        num_preemptions, self._num_preemptions_since_stats = self._num_preemptions_since_stats, 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries if prefix else 0,
            prefix_cache_hits=prefix.hits if prefix else 0,
            num_preemptions=num_preemptions,
            step_counter=self.step_counter,
        )

    def shutdown(self) -> None:
        """Nothing to release in the base scheduler; plugins that open files override it."""

    def iter_requests(self) -> Iterable[Request]:
        """Every live request (waiting, preempted or running)."""
        return self.requests.values()


def _row_starts(output: ModelRunnerOutput) -> list[int]:
    """The first logprobs row of each request: rows are the sampled tokens of all requests, in order."""
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
