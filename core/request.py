"""``Request``: the scheduler's view of one request, built from an ``EngineCoreRequest``.

It holds the token streams (prompt, verified output, unverified draft tokens), the progress counters the
scheduler works with (``num_computed_tokens`` above all) and the chained block hashes the prefix cache looks up.
"""

from __future__ import annotations

import enum
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllite.lora import LoRARequest
    from vllite.pooling_params import PoolingParams
    from vllite.protocol import EngineCoreEvent, EngineCoreRequest, FinishReason
    from vllite.sampling_params import SamplingParams
    from vllite.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Everything after ``PREEMPTED`` counts as finished."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    # A session between turns: out of the queues, waiting for its next input chunk (vllite.sched.sessions).
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Finished states, in this order:
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()  # its output repeats (SamplingParams.repetition_detection)

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_blocked_waiting(status: RequestStatus) -> bool:
        """Waiting on something outside the scheduler (its grammar compiling, a KV load): skipped by admission,
        without holding up the requests behind it, until it resolves."""
        return status in _BLOCKED_WAITING

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _finished_reasons().get(status)


_BLOCKED_WAITING = frozenset(
    {RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, RequestStatus.WAITING_FOR_REMOTE_KVS}
)


@functools.cache
def _finished_reasons() -> dict[RequestStatus, FinishReason]:
    from vllite.protocol import FinishReason

    return {
        RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
        RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
        RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
        RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
        RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
    }


BlockHasher = Callable[["Request"], list[bytes]]


def _num_rows(embeds: Any) -> int:
    """The rows of a ``prompt_embeds`` value from the wire (0 for anything without a first dimension)."""
    shape = getattr(embeds, "shape", None)
    return int(shape[0]) if isinstance(shape, tuple | list) and shape and isinstance(shape[0], int) else 0


@dataclass(frozen=True, slots=True)
class StreamingUpdate:
    """The next input chunk of a session: tokens to append and the sampling parameters of the turn they start."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float

    @classmethod
    def from_request(cls, request: Request) -> StreamingUpdate | None:
        """The update a continuation request carries; ``None`` for the end of the session's input."""
        if not request.resumable:
            return None
        return cls(request.prompt_token_ids, request.sampling_params, request.arrival_time)


@functools.cache
def _pooling_sampling_params() -> SamplingParams:
    """What the scheduler sees of a pooling request: one step past its prompt. It finishes when the model runner
    returns its pooled output, at the end of its prefill, and never samples."""
    from vllite.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0)


class Request:
    """One request inside the engine core.

    ``block_hasher`` (from ``vllite.kv_cache``) is called whenever tokens are appended; it returns the hashes of
    blocks that became full, so every full block is hashed exactly once.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        *,
        client_index: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        block_hasher: BlockHasher | None = None,
        trace_headers: dict[str, str] | None = None,
        pooling_params: PoolingParams | None = None,
        resumable: bool = False,
        continuation: bool = False,
        prompt_embeds: Any = None,
    ) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.arrival_time = arrival_time
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.lora_name = lora_request.lora_name if lora_request is not None else None
        self.trace_headers = trace_headers
        self.pooling_params = pooling_params
        # A session keeps its KV between turns; chunks that arrive while a turn runs wait here (None: input ended).
        self.resumable = resumable
        self.continuation = continuation
        self.streaming_queue: deque[StreamingUpdate | None] | None = deque() if resumable else None
        # A parked session: the status its last turn ended with (restored if the session ends while parked).
        self.last_turn_status: RequestStatus | None = None

        # An embeds prompt: the float tensor [num_prompt_tokens, hidden_size], kept for a recompute after preemption;
        # prompt_token_ids then holds placeholder zeros (vLLM's) and the block hashes cover the embeddings.
        self.prompt_embeds = prompt_embeds
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.max_tokens: int = sampling_params.max_tokens if sampling_params.max_tokens is not None else 1 << 62

        self._init_progress()

        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    def _init_progress(self) -> None:
        """The engine's bookkeeping of a new request: its status, computed tokens, events and per-request
        state that scheduler policies, connectors and structured outputs attach."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Set with FINISHED_ERROR: what failed (the plugin, its hook and the exception), reported to the client.
        self.error: str | None = None
        self.events: list[EngineCoreEvent] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Async scheduling (vllite.sched.async_placeholders): tokens of steps in flight not yet sampled, already
        # counted in num_computed_tokens.
        self.num_output_placeholders = 0
        self.is_prefill_chunk = False
        # Tokens a KV connector supplied at the latest admission (beyond the local prefix-cache hit).
        self.num_external_computed_tokens = 0
        # What the KV connector returned from ``request_finished``; sent on the request's last output.
        self.kv_transfer_params: dict[str, Any] | None = None
        # The grammar of a request with structured outputs (set by the engine's StructuredOutputManager).
        self.structured_output_request: StructuredOutputRequest | None = None
        # Free-form per-request state for scheduler policies (e.g. Continuum's job id); never sent anywhere.
        self.extra: dict[str, Any] = {}
        # --enable-return-routed-experts: the expert ids of the positions computed so far (vllite.sched.routed_experts).
        self.routed_experts: list[Any] = []

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest, block_hasher: BlockHasher | None = None) -> Request:
        sampling_params = request.sampling_params
        if request.pooling_params is not None:
            sampling_params = _pooling_sampling_params()
        elif sampling_params is None:
            raise ValueError(f"Request {request.request_id!r} has neither sampling_params nor pooling_params.")
        prompt_token_ids = request.prompt_token_ids or []
        if request.prompt_embeds is not None and not prompt_token_ids:
            prompt_token_ids = [0] * _num_rows(request.prompt_embeds)  # placeholders; check_request checks the rest
        return cls(
            request_id=request.request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=sampling_params,
            pooling_params=request.pooling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            client_index=request.client_index,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=request.lora_request,
            block_hasher=block_hasher,
            trace_headers=request.trace_headers,
            resumable=request.resumable,
            continuation=request.continuation,
            prompt_embeds=request.prompt_embeds,
        )

    # ------------------------------------------------------------------ token streams
    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def use_structured_output(self) -> bool:
        """Whether the request has a structured-output constraint (``SamplingParams.structured_outputs``)."""
        return self.sampling_params.structured_outputs is not None

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def start_next_turn(self, update: StreamingUpdate) -> None:
        """A session's next turn: everything so far (the last sampled token included) becomes the prompt, the
        update's tokens are appended, and the turn runs with the update's sampling parameters. The KV already
        computed (``num_computed_tokens``) is kept, so only the new tokens are prefilled."""
        self._all_token_ids.extend(update.prompt_token_ids)
        self.prompt_token_ids = list(self._all_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids = []
        self.spec_token_ids = []
        self.sampling_params = update.sampling_params
        max_tokens = update.sampling_params.max_tokens
        self.max_tokens = max_tokens if max_tokens is not None else 1 << 62
        self.arrival_time = update.arrival_time
        self.status = RequestStatus.WAITING
        self.stop_reason = None
        self.last_turn_status = None
        self.num_cached_tokens = -1
        self.update_block_hashes()

    # ------------------------------------------------------------------ lifecycle
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def record_event(self, event_type: Any, timestamp: float | None = None) -> None:
        from vllite.protocol import EngineCoreEvent

        self.events.append(EngineCoreEvent.new_event(event_type, timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def __lt__(self, other: Request) -> bool:
        """Heap order for priority scheduling: lower priority value first, then arrival, then id."""
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        if self.request_id != other.request_id:
            return self.request_id < other.request_id
        return id(self) < id(other)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
