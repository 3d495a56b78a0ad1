"""The wire protocol between the frontend and the engine core: msgspec Structs and enums.

The hot-path Structs are ``array_like`` (positional msgpack arrays), so **field order is the wire format**:
append new fields at the end, with defaults, and old peers keep decoding. Tensors (prompt logprobs) travel as
raw buffers through ``vllite.plugins.engine_proc.serial``; nothing here is ever pickled.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from vllite.lora.request import LoRARequest
from vllite.pooling_params import PoolingParams
from vllite.sampling_params import SamplingParams

FINISH_REASON_STRINGS = ("stop", "length", "abort", "error", "repetition")


class FinishReason(enum.IntEnum):
    """Why a request finished. An IntEnum so it costs one byte on the wire; ``str()`` gives the API string."""

    STOP = 0  # a stop token or stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client
    ERROR = 3  # request-level internal error
    REPETITION = 4  # repetitive pattern detected

    def __str__(self) -> str:
        return FINISH_REASON_STRINGS[self.value]


class EngineCoreRequestType(enum.Enum):
    """The first frame of every client → engine message: one raw byte, used directly as the type id."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    EXECUTOR_FAILED = b"\x04"
    WAKEUP = b"\x05"


class EngineCoreEventType(enum.IntEnum):
    """Lifecycle events recorded per request when stats are on."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct):
    """A timestamped lifecycle event of one request. Monotonic time: valid only inside one process."""

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType, timestamp: float | None = None) -> EngineCoreEvent:
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenized, validated request as the engine core receives it."""

    request_id: str
    prompt_token_ids: list[int] | None
    sampling_params: SamplingParams | None
    eos_token_id: int | None
    arrival_time: float
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    client_index: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    # Data parallel: the engine this request must go to (None: the client's router chooses).
    data_parallel_rank: int | None = None
    # Data parallel in lockstep: the wave the client believed current when it sent the request.
    current_wave: int = 0
    # A request to a pooling model carries these instead of sampling_params.
    pooling_params: PoolingParams | None = None
    # A session (streaming input): the request keeps its KV between turns and takes its input in chunks.
    resumable: bool = False
    # A later chunk of the live session of this id (its tokens, and its turn's sampling_params); with
    # ``resumable`` False and no tokens: the end of the session's input.
    continuation: bool = False
    # An embeds prompt (vLLM's ``EmbedsPrompt``): a float tensor ``[num_tokens, hidden_size]`` in place of token
    # ids (``prompt_token_ids`` is None). It travels as a raw buffer (``engine_proc.serial``), never pickled.
    prompt_embeds: Any = None

    @property
    def params(self) -> SamplingParams:
        assert self.sampling_params is not None
        return self.sampling_params

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request is not None else None


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Sample logprobs of the new tokens of one step, one row per token.

    Row ``i`` holds the sampled token first, then the top-N tokens: ``logprob_token_ids[i]``, their
    ``logprobs[i]``, and ``sampled_token_ranks[i]`` (1 = most likely) of the sampled token.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


class LogprobsTensors(msgspec.Struct, array_like=True, gc=False):
    """Prompt logprobs of a prefill chunk as tensors (``[num_positions, N + 1]``); carried as raw buffers."""

    logprob_token_ids: Any
    logprobs: Any
    selected_token_ranks: Any


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Speculative-decoding figures since the previous ``SchedulerStats`` (vLLM's names and meanings).

    ``num_drafts``: verification steps of requests that had drafts; ``num_draft_tokens``: drafts verified;
    ``num_accepted_tokens``: drafts accepted; ``num_accepted_tokens_per_pos[i]``: drafts accepted at draft
    position ``i`` (``num_spec_tokens`` entries).
    """

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        """Empty figures for drafts of up to ``num_spec_tokens`` tokens."""
        return cls(num_spec_tokens=num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Counts one request's verification: ``num_draft_tokens`` drafts, the first ``num_accepted_tokens``
        of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for position in range(min(num_accepted_tokens, len(per_pos))):
            per_pos[position] += 1


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's scheduler figures, for logging and the stats observer (``spec_decoding_stats``: with
    speculative decoding, its figures since the previous stats)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_counter: int = 0
    spec_decoding_stats: SpecDecodingStats | None = None
    # Of ``num_waiting_reqs``, those deferred by a transient constraint (a KV load or a grammar compiling) rather
    # than waiting for capacity (vLLM's ``num_requests_waiting_by_reason``).
    num_skipped_waiting_reqs: int = 0
    # The KV connector's lookups of admitted requests (tokens asked for, tokens it had), with a connector only.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's output for one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs_tensors: LogprobsTensors | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    num_nans_in_logits: int = 0
    # Why the request failed (``finish_reason`` ERROR): the plugin, the hook and the exception, or the check.
    error: str | None = None
    # A pooling request's result (a float32 tensor, carried as a raw buffer), on its finishing output.
    pooling_output: Any = None
    # A session's turn ended (``finish_reason`` says why) and the session waits for its next input chunk.
    session_open: bool = False
    # --enable-return-routed-experts, on the finishing output: int16 [positions, moe_layers, top_k] expert ids.
    routed_experts: Any = None

    @property
    def finished(self) -> bool:
        """Whether the request is over: a finish reason that does not only end a session's turn."""
        return self.finish_reason is not None and not self.session_open


class UtilityResult(msgspec.Struct, array_like=True, gc=False):
    """Wraps a utility call's return value so any msgpack-encodable result can travel."""

    result: Any = None


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    """The answer to one utility call: a result, or a failure message; never both."""

    call_id: int
    failure_message: str | None = None
    result: UtilityResult | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """All outputs of one step for one client, plus utility answers and finished-request notices."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()


class EngineInfo(msgspec.Struct, frozen=True):
    """What the engine settled on at start-up, reported once: in the handshake, or directly when in-process.

    The frontend is built from it (requests are validated against these limits); nothing writes it back into a
    config.
    """

    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    scheduler: str = ""
    dp_stats_address: str | None = None  # data parallel: where the coordinator publishes engine stats
    supported_tasks: tuple[str, ...] = ("generate",)  # "generate", or the pooling tasks of a pooling model
    hidden_size: int = 0  # the width of a prompt_embeds row
    enable_prompt_embeds: bool = False  # whether prompt_embeds inputs are accepted (--enable-prompt-embeds)
    dtype: str = ""  # the model's dtype as resolved from --dtype (auto → e.g. "bfloat16"); "": the executor said none


class EngineShutdownState(enum.IntEnum):
    """RUNNING → (signal) REQUESTED → (draining) SHUTTING_DOWN → exit."""

    RUNNING = 0
    REQUESTED = 1
    SHUTTING_DOWN = 2
