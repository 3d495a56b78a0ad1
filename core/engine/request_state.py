"""``RequestState``: the client-side state of one (child) request while its outputs are processed: ids, prompt,
detokenizer, logprobs, output kind, stream interval, output queue; for a session, its turns."""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec

from vllite.engine.detokenizer import IncrementalDetokenizer
from vllite.engine.logprobs import LogprobsProcessor
from vllite.engine.parallel_sampling import ParentRequest
from vllite.engine.sessions import SessionTurns
from vllite.engine.stats import RequestStateStats
from vllite.outputs import CompletionOutput, RequestOutput
from vllite.protocol import EngineCoreRequest, FinishReason
from vllite.sampling_params import RequestOutputKind


class OutputQueue(Protocol):
    """Where a request's outputs go in async use: anything with ``put``."""

    def put(self, output: RequestOutput | Exception) -> None: ...


class RequestState:
    """Client-side state of one (child) request: ids, prompt, detokenizer, logprobs, output kind, queue; for a
    session, its turns (``vllite.engine.sessions``)."""

    def __init__(
        self,
        request: EngineCoreRequest,
        external_req_id: str,
        prompt: str | None,
        tokenizer: Any,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        queue: OutputQueue | None = None,
        log_stats: bool = False,
        stream_interval: int = 1,
    ) -> None:
        self.request_id = request.request_id
        self.stream_interval = stream_interval
        self.external_req_id = external_req_id
        self.parent_req = parent_req
        self.request_index = request_index
        self.lora_request = request.lora_request
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.queue = queue
        self.error: str | None = None  # the engine's message for an ERROR finish
        self.routed_experts: Any = None  # --enable-return-routed-experts: the finishing output's expert ids
        self.session = SessionTurns(context_token_ids=[]) if request.resumable else None
        self.start_turn(request, prompt)

    def start_turn(self, request: EngineCoreRequest, prompt: str | None) -> None:
        """The per-request (for a session: per-turn) state: prompt, detokenizer, logprobs, output kind, stats."""
        params = request.params
        prompt_token_ids = request.prompt_token_ids or []
        if request.prompt_embeds is not None:  # an embeds prompt: placeholder ids, one per row (as vLLM reports)
            prompt_token_ids = [0] * len(request.prompt_embeds)
        session = self.session
        if session is not None:
            session.context_token_ids.extend(prompt_token_ids)
            session.awaiting_input, session.params = False, params
            prompt_token_ids = list(session.context_token_ids)
            request = msgspec.structs.replace(request, prompt_token_ids=prompt_token_ids)
        self.output_kind = params.output_kind
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_len = len(prompt_token_ids)
        tokenizer = self.tokenizer if params.detokenize else None
        self.detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        self.logprobs_processor = LogprobsProcessor.from_new_request(tokenizer, request)
        self.max_tokens_param = params.max_tokens
        self.n, self.top_p, self.temperature = params.n, params.top_p, params.temperature
        self.num_cached_tokens = 0
        self.is_prefilling = True
        self.sent_tokens_offset = 0  # output tokens handed out so far (for stream_interval)
        self.stats = None
        if self.log_stats:
            self.stats = RequestStateStats.for_request(request, self.external_req_id, self.parent_req)

    def make_request_output(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        kv_transfer_params: dict[str, Any] | None = None,
        *,
        session_open: bool = False,
    ) -> RequestOutput | None:
        """The output to emit now, or None (FINAL_ONLY before the end, or n>1 siblings still running).
        ``session_open``: the finish reason only ends a session's turn, so the output is not ``finished``."""
        if finish_reason is None and self.output_kind == RequestOutputKind.FINAL_ONLY:
            return None
        if self.stream_interval > 1:
            # vLLM's --stream-interval: the first token, then every stream_interval tokens, and the last.
            num_tokens = self.detokenizer.num_output_tokens()
            sent = self.sent_tokens_offset
            if finish_reason is None and sent and num_tokens - sent < self.stream_interval:
                return None
            if self.output_kind == RequestOutputKind.DELTA:
                new_token_ids = self.detokenizer.output_token_ids[sent:]
            self.sent_tokens_offset = num_tokens
        completion = self._new_completion_output(new_token_ids, finish_reason, stop_reason)
        finished = finish_reason is not None and not session_open
        external_req_id = self.external_req_id
        if self.parent_req is None:
            outputs = [completion]
        else:
            outputs, finished = self.parent_req.get_outputs(self.request_id, completion)
            if not outputs:
                return None
            external_req_id = self.parent_req.external_req_id
        delta = self.output_kind == RequestOutputKind.DELTA
        processor = self.logprobs_processor
        prompt_logprobs = processor.pop_prompt_logprobs() if delta else processor.prompt_logprobs
        return self.request_output(external_req_id, outputs, finished, prompt_logprobs, kv_transfer_params)

    def request_output(
        self,
        request_id: str,
        outputs: list[CompletionOutput],
        finished: bool,
        prompt_logprobs: Any = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> RequestOutput:
        """A ``RequestOutput`` of this request's prompt and state with the given completions."""
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.stats,
            kv_transfer_params=kv_transfer_params,
            lora_request=self.lora_request,
        )

    def error_completion(self, message: str) -> CompletionOutput:
        """This sample's final output after a client-side failure: the text and tokens so far (a token that fails
        to decode ends the text), ``finish_reason="error"`` and ``message``."""
        return CompletionOutput(
            index=self.request_index,
            text=self.detokenizer.text_so_far(),
            token_ids=list(self.detokenizer.output_token_ids),
            finish_reason=str(FinishReason.ERROR),
            error=message,
        )

    def _new_completion_output(
        self, token_ids: list[int], finish_reason: FinishReason | None, stop_reason: int | str | None
    ) -> CompletionOutput:
        finished = finish_reason is not None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        if not delta:
            token_ids = list(self.detokenizer.output_token_ids)
        logprobs = self.logprobs_processor.logprobs
        if logprobs is not None:
            logprobs = logprobs[len(logprobs) - len(token_ids) :] if delta else list(logprobs)
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None,
            error=self.error if finished else None,
            routed_experts=self.routed_experts if finished else None,
        )

    def queue_chunk(self, chunk: EngineCoreRequest, prompt_text: str | None) -> None:
        """A chunk sent to the engine: its turn starts now if the session waits for input, else after the turns
        queued before it."""
        session = self.session
        assert session is not None
        if not chunk.resumable:
            session.input_ended = True
        elif session.awaiting_input and not session.pending:
            self.start_turn(chunk, prompt_text)
        else:
            session.pending.append((chunk, prompt_text))

    def end_turn(self) -> None:
        """The engine ended a turn: its tokens join the context; the next queued chunk's turn starts, or the session
        waits for input (with an empty turn, so that a final output carries no old text)."""
        session = self.session
        assert session is not None and session.params is not None
        session.context_token_ids.extend(self.detokenizer.output_token_ids)
        if session.pending:
            self.start_turn(*session.pending.popleft())
        else:
            empty = EngineCoreRequest(self.request_id, [], session.params, None, time.time(), resumable=True)
            self.start_turn(empty, None)
            session.awaiting_input = True
