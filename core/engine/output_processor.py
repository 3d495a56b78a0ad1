"""``OutputProcessor``: engine-core outputs → ``RequestOutput``s, on the client side of the engine.

Per step it detokenizes each request's new tokens, checks stop strings (a hit finishes the request here and
lists it in ``reqs_to_abort`` so the engine frees it), collects logprobs, gathers ``n > 1`` children through
their ``ParentRequest``, and shapes each output by its kind: CUMULATIVE, DELTA or FINAL_ONLY. Outputs go to
the caller (``LLMEngine``) or, for async use, into a per-request queue (an ``OutputQueue``, such as
``AsyncLLM``'s ``RequestOutputCollector``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllite import deprecated_aliases
from vllite.engine.parallel_sampling import ParentRequest
from vllite.engine.pooling import PoolingRequestState
from vllite.engine.request_state import OutputQueue, RequestState
from vllite.engine.sessions import session_of
from vllite.engine.stats import IterationStats
from vllite.exceptions import RequestProcessingError, SessionClosedError
from vllite.outputs import CompletionOutput, RequestOutput
from vllite.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllite.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class OutputProcessorOutput:
    """One step's result: the outputs to hand out, and requests the engine must abort (stop strings)."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Turns ``EngineCoreOutput``s into ``RequestOutput``s; holds every unfinished request's ``RequestState``.

    ``request_states`` is keyed by internal id; ``external_req_ids`` maps each external id to its internal ids
    (several for ``n > 1`` or reused ids). Add a request here *before* sending it to the engine.
    """

    def __init__(self, tokenizer: Any, log_stats: bool = False, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.stream_interval = stream_interval
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self.external_req_ids: defaultdict[str, list[str]] = defaultdict(list)

    def get_num_unfinished_requests(self) -> int:
        """Unfinished (child) requests: a prompt with ``n=4`` counts 4."""
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return len(self.request_states) > 0

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        queue: OutputQueue | None = None,
        *,
        external_req_id: str | None = None,
    ) -> None:
        """Registers a (child) request under its engine id; ``external_req_id`` (default: the engine id) is the
        caller's id that ``RequestOutput.request_id`` shows. ``ValueError`` if the engine id is in flight."""
        req_id = request.request_id
        if req_id in self.request_states:
            raise ValueError(f"Request id {req_id!r} is already running.")
        external = external_req_id or (parent_req.external_req_id if parent_req is not None else req_id)
        state: Any
        if request.pooling_params is not None:
            state = PoolingRequestState(request, external, queue)
        else:
            state = RequestState(
                request,
                external,
                prompt,
                self.tokenizer,
                parent_req,
                request_index,
                queue,
                self.log_stats,
                self.stream_interval,
            )
        self.request_states[req_id] = state
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req
        self.external_req_ids[state.external_req_id].append(req_id)

    def process_outputs(
        self,
        outputs: Iterable[EngineCoreOutput],
        engine_core_timestamp: float | None = None,
        iteration_stats: IterationStats | None = None,
    ) -> OutputProcessorOutput:
        """The one loop over a step's outputs: detokenize, check stop strings, build ``RequestOutput``s.

        Outputs of unknown (already finished or aborted) requests are ignored. ``request_outputs`` keep the
        order of ``outputs``; queued requests get theirs in their queue instead. ``engine_core_timestamp`` is the
        engine's ``time.monotonic()`` reading for the batch (default: now). With stats on, the per-request
        ``RequestStateStats`` are updated and, when given, ``iteration_stats`` gets the batch's figures.
        """
        result = OutputProcessorOutput()
        now = engine_core_timestamp if engine_core_timestamp is not None else time.monotonic()
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue
            if isinstance(state, PoolingRequestState):
                self._process_pooling_output(state, output, result)
                continue
            try:
                self._process_output(state, output, now, result, iteration_stats)
            except Exception as exc:  # detokenizer, stop strings, logprobs: this request fails, no other
                self._fail_request(state, exc, result)
        return result

    def _process_output(
        self,
        state: RequestState,
        output: EngineCoreOutput,
        now: float,
        result: OutputProcessorOutput,
        iteration_stats: IterationStats | None,
    ) -> None:
        new_token_ids = output.new_token_ids
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        state.num_cached_tokens = output.num_cached_tokens
        state.error = output.error
        state.routed_experts = output.routed_experts
        state.is_prefilling = False
        stats = state.stats
        if stats is not None:
            preempted = stats.record_events(output.events) if output.events else 0
            if iteration_stats is not None:
                iteration_stats.num_preempted_reqs += preempted
            stats.record_tokens(len(new_token_ids), output.num_cached_tokens, now, state.prompt_len, iteration_stats)
            stats.is_corrupted = stats.is_corrupted or output.num_nans_in_logits > 0
        stop_string = state.detokenizer.update(new_token_ids, finish_reason == FinishReason.STOP)
        if stop_string is not None:
            finish_reason, stop_reason = FinishReason.STOP, stop_string
        state.logprobs_processor.update_from_output(output)
        request_output = state.make_request_output(
            new_token_ids, finish_reason, stop_reason, output.kv_transfer_params, session_open=output.session_open
        )
        if request_output is not None:
            if state.queue is not None:
                state.queue.put(request_output)
            else:
                result.request_outputs.append(request_output)
        if finish_reason is not None:
            if stats is not None and iteration_stats is not None:
                iteration_stats.record_finished(str(finish_reason), state.prompt_len, stats)
            if output.session_open:
                state.end_turn()
                return
            self._finish_request(state)
            if not output.finished:
                result.reqs_to_abort.append(state.request_id)

    def add_session_chunk(self, chunk: EngineCoreRequest, prompt: str | None) -> None:
        """Registers the next input chunk (or, ``resumable`` False, the end of the input) of the live session
        ``chunk.request_id`` (an engine id), before it is sent; ``SessionClosedError`` when no session is open."""
        state = self.request_states.get(chunk.request_id)
        session_of(state, chunk.request_id)
        assert isinstance(state, RequestState)
        state.queue_chunk(chunk, prompt)

    def session_engine_id(self, request_id: str) -> str:
        """The engine id of the open session whose caller id (or engine id) is ``request_id``."""
        for engine_id in (request_id, *self.external_req_ids.get(request_id, ())):
            state = self.request_states.get(engine_id)
            if getattr(state, "session", None) is not None:
                return engine_id
        raise SessionClosedError(f"Session {request_id!r} is not open (unknown, finished, or its input already ended).")

    def session_params(self, request_id: str) -> SamplingParams:
        """The sampling parameters of the latest turn of the open session ``request_id`` (an engine id)."""
        params = session_of(self.request_states.get(request_id), request_id).params
        assert params is not None
        return params

    def _process_pooling_output(
        self, state: PoolingRequestState, output: EngineCoreOutput, result: OutputProcessorOutput
    ) -> None:
        pooled = state.make_output(output)
        if pooled is None:
            return
        if state.queue is not None:
            state.queue.put(pooled)
        else:
            result.request_outputs.append(pooled)  # type: ignore[arg-type]
        self._finish_request(state)  # type: ignore[arg-type]

    def _fail_request(self, state: RequestState, exc: Exception, result: OutputProcessorOutput) -> None:
        """Finishes the request whose output could not be processed (all ``n > 1`` siblings with it) with
        ``finish_reason="error"`` and lists it in ``reqs_to_abort``. Async use: its queue gets a
        ``RequestProcessingError`` (the stream raises it); sync use: the step returns an error output."""
        error = RequestProcessingError(state.external_req_id, exc)
        logger.warning("%s; the request is aborted, the engine goes on", error, exc_info=exc)
        parent = state.parent_req
        siblings = [state]
        if parent is not None:
            siblings = [self.request_states[i] for i in sorted(parent.child_requests) if i in self.request_states]
        completions: list[CompletionOutput] = []
        for sibling in siblings:
            completion = sibling.error_completion(str(error))
            if parent is None:
                completions = [completion]
            else:
                outputs, _ = parent.get_outputs(sibling.request_id, completion)
                completions = outputs if parent.final_only else completions + outputs
            self._finish_request(sibling)
            result.reqs_to_abort.append(sibling.request_id)
        if state.queue is not None:
            state.queue.put(error)
            return
        request_id = parent.external_req_id if parent is not None else state.external_req_id
        result.request_outputs.append(state.request_output(request_id, completions, finished=True))

    def abort_requests(
        self, request_ids: Iterable[str], internal: bool = False, iteration_stats: IterationStats | None = None
    ) -> list[str]:
        """Drops the requests' state; returns the internal ids to abort in the engine.

        An id may be external (all its internal ids, ``n > 1`` children included), internal, or a parent's
        internal id (all its children). With ``internal=True`` ids are looked up as internal ids first.
        Queued requests get a final ``finish_reason="abort"`` output; others get none. With stats on and
        ``iteration_stats`` given, each aborted request is recorded there as finished with ``abort``.
        """
        internal_ids: list[str] = []
        for req_id in request_ids:
            internal_ids.extend(self._resolve(req_id, internal))
        aborted = []
        for req_id in dict.fromkeys(internal_ids):
            state = self.request_states.get(req_id)
            if state is None:
                continue
            if state.queue is not None:
                output = state.make_request_output([], FinishReason.ABORT, None)
                if output is not None:
                    state.queue.put(output)
            if iteration_stats is not None and state.stats is not None:
                iteration_stats.record_finished(str(FinishReason.ABORT), state.prompt_len, state.stats)
            self._finish_request(state)
            aborted.append(req_id)
        return aborted

    def propagate_error(self, exc: Exception) -> None:
        """Puts ``exc`` into every request's queue (async use: the engine died)."""
        for state in self.request_states.values():
            if state.queue is not None:
                state.queue.put(exc)

    def fail_all(self, exc: Exception) -> list[str]:
        """Ends every request: ``exc`` goes into each queue (its stream raises it) and all state is dropped
        (async use: shutdown, or an output handler that cannot go on). Returns the internal ids."""
        self.propagate_error(exc)
        request_ids = list(self.request_states)
        for state in list(self.request_states.values()):
            self._finish_request(state)
        return request_ids

    # ------------------------------------------------------------------ helpers
    def _resolve(self, req_id: str, internal: bool) -> list[str]:
        if internal and req_id in self.request_states:
            return [req_id]
        if req_id in self.external_req_ids:
            return list(self.external_req_ids[req_id])
        parent = self.parent_requests.get(req_id)
        if parent is not None:
            return sorted(parent.child_requests)
        return [req_id] if req_id in self.request_states else []

    def _finish_request(self, state: RequestState) -> None:
        req_id = state.request_id
        self.request_states.pop(req_id, None)
        siblings = self.external_req_ids.get(state.external_req_id)
        if siblings is not None:
            if req_id in siblings:
                siblings.remove(req_id)
            if not siblings:
                del self.external_req_ids[state.external_req_id]
        parent = state.parent_req
        if parent is not None:
            parent.child_requests.discard(req_id)
            if not parent.child_requests:
                self.parent_requests.pop(parent.request_id, None)


def __getattr__(name: str) -> object:
    return deprecated_aliases.moved_attribute(__name__, name)  # AsyncLLM's output queue, now beside it
