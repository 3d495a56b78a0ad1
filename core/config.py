"""The engine's configuration: frozen ``EngineConfig`` groups (what the engine parts read).

``EngineConfig`` exposes the attribute paths vLLM plugins read from ``VllmConfig``
(``model_config.max_model_len``, ``model_config.get_vocab_size()``, ``model_config.runner_type``,
``cache_config.block_size``, ``scheduler_config.max_num_seqs``, ``parallel_config``, ``speculative_config``,
``device_config.device`` ...), and is also importable as ``VllmConfig``. What users type, and the one argument parser
built from it, is ``vllite.engine_args.EngineArgs``; its ``create_engine_config()`` checks the arguments and makes
the ``EngineConfig``.

Every config is frozen: it says what the user asked for and never changes. What the engine settles on at
start-up (the context length when the user gave none, the KV block count) is reported as an ``EngineInfo``;
the engine's own parts read a copy made with :meth:`EngineConfig.with_limits`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vllite.deprecated_aliases import moved_attribute
from vllite.lora.config import LoRAConfig
from vllite.speculative_config import SpeculativeConfig
from vllite.structured_output.params import StructuredOutputsConfig

if TYPE_CHECKING:
    from vllite.kv_connector.config import KVTransferConfig
    from vllite.kv_events import KVEventsConfig

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")  # half, float: vLLM's float16, float32
HASH_ALGOS = ("sha256", "fast")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's; fp8 = fp8_e4m3 (vllite.kernels.kv_cache_dtype)
DP_ROUTINGS = ("load", "prefix")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
#: vLLM's switch for counting NaN logits per request (``num_nans_in_logits``, ``corrupted_requests``); both read.
COMPUTE_NANS_ENVS = ("VLLITE_COMPUTE_NANS_IN_LOGITS", "VLLM_COMPUTE_NANS_IN_LOGITS")
# Token budget per step when the user gives none (vLLM's default with chunked prefill).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# Architectures that are pooling models as they stand (BertModel, Qwen2ForSequenceClassification, ...).
_POOLING_ARCH_SUFFIXES = ("Model", "ForSequenceClassification", "ForTokenClassification", "ForRewardModel")


@dataclass(frozen=True)
class ModelConfig:
    """Which model, in which precision, with how long a context (``None``: the model's own limit).

    ``runner`` is vLLM's ``--runner``: ``"generate"``, ``"pooling"`` (embedding, classification, scoring), or
    ``"auto"``: pooling for a sentence-transformers folder, a ``*ForSequenceClassification`` (or token
    classification, reward) architecture or a bare encoder (``BertModel``), generate otherwise. ``convert``
    (``"embed"``, ``"classify"``) turns a decoder checkpoint into a pooling model; ``pooler_config`` overrides the
    pooler's defaults (``pooling_type``, ``normalize``, ``dimensions``, ``use_activation``).

    Also answers what vLLM plugins read from vLLM's ``ModelConfig``: ``runner_type`` (the resolved ``runner``),
    ``tokenizer_mode``, ``tokenizer_revision`` / ``revision`` (the Hub revisions asked for), ``hf_config``,
    ``hf_text_config``, ``vocab_size`` / ``get_vocab_size()`` and ``get_hidden_size()``.
    """

    tokenizer_mode: ClassVar[str] = "auto"

    model: str | None = None  # a local folder: EngineArgs resolves a Hub id to its snapshot folder
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # vLLM's --quantization; None: whatever the checkpoint's quantization_config says
    max_model_len: int | None = None
    seed: int = 0
    trust_remote_code: bool = False
    # The most logprobs (``logprobs`` / ``prompt_logprobs``) a request may ask for; -1: no limit but the vocabulary.
    max_logprobs: int = 20
    skip_tokenizer_init: bool = False
    # "auto": default sampling parameters from the model folder's generation_config.json; "vllm": none;
    # any other value: a folder holding a generation_config.json.
    generation_config: str = "auto"
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict[str, Any] | None = None
    # vLLM's --enable-sleep-mode: sleep (levels 1 and 2) and wake_up are allowed only when the engine starts with it.
    enable_sleep_mode: bool = False
    # Accept ``prompt_embeds`` inputs (vLLM's --enable-prompt-embeds): prompts given as embedding rows.
    enable_prompt_embeds: bool = False
    # vLLM's --enable-return-routed-experts: a MoE model's finished outputs carry each computed position's top-k
    # expert ids per MoE layer (CompletionOutput.routed_experts).
    enable_return_routed_experts: bool = False
    # What sampled-token logprobs hold (vLLM's --logprobs-mode, one of LOGPROBS_MODES): raw = from the model's
    # logits, processed = from those sampled from (processors, penalties, temperature, top-k/p applied).
    logprobs_mode: str = "raw_logprobs"

    # transformers' config of the model folder (what vLLM plugins read as ``model_config.hf_config``): read
    # once when the config is created, if the folder has a config.json; the executor reports a missing one.
    hf_config: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.hf_config is None and self.model and os.path.isfile(os.path.join(self.model, "config.json")):
            from vllite.model_files import load_hf_config

            hf_config = load_hf_config(self.model, trust_remote_code=self.trust_remote_code)
            object.__setattr__(self, "hf_config", hf_config)  # part of construction, not a later mutation

    @property
    def runner_type(self) -> str:
        """``"generate"`` or ``"pooling"``: the ``runner`` asked for, or the one the checkpoint implies."""
        if self.runner != "auto":
            return self.runner
        if self.convert in ("embed", "classify") or self.pooler_config is not None:
            return "pooling"
        architectures = getattr(self.hf_config, "architectures", None) or []
        pooling_arch = any(a.endswith(_POOLING_ARCH_SUFFIXES) for a in architectures)
        folder = self.model or ""
        return "pooling" if pooling_arch or os.path.isfile(os.path.join(folder, "modules.json")) else "generate"

    @property
    def hf_text_config(self) -> Any:
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (the width of the logits); 0 when the model folder has no config."""
        return int(getattr(self.hf_text_config, "vocab_size", 0) or 0)

    def get_vocab_size(self) -> int:
        """``vocab_size``, under vLLM's method name."""
        return self.vocab_size

    def get_hidden_size(self) -> int:
        """The model's hidden size (vLLM's method name); 0 when the model folder has no config."""
        return int(getattr(self.hf_text_config, "hidden_size", 0) or 0)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, prefix caching, and how much memory it may take."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks: int | None = None  # the block count allocated (in the engine's copy, see with_limits)
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    gpu_memory_utilization_given: bool = False  # set by the user (an executor on the CPU warns that it ignores it)
    cpu_kvcache_space_gib: float | None = None  # default: VLLITE_CPU_KVCACHE_SPACE or 4 GiB
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler: budgets, chunked prefill and the policy plugin to use."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None  # default: 2048, or max_model_len without chunked prefill
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduler_cls: str | None = None  # registered name or class path; None = scheduling_policy
    scheduling_policy: str = "fcfs"
    num_lookahead_tokens: int = 0
    batch_queue_depth: int = 1
    # Plan step N+1 while step N runs, with output placeholders (vllite.sched.async_scheduler); 2 batches in flight.
    async_scheduling: bool = False
    # Models mixing sliding-window and full-attention layers keep one block table per KV-cache group, and the
    # sliding groups free what leaves their window; True keeps one table and every layer's KV in every block.
    disable_hybrid_kv_cache_manager: bool = False
    tool_call_estimator: str = "utility"
    policy_args: dict[str, Any] = field(default_factory=dict)
    # Frontend: a streamed request's outputs are handed out every this many tokens (and at its first and last).
    stream_interval: int = 1
    # Admission gates (vLLM's names and defaults): admit a waiting request only when its whole current sequence
    # fits in the free KV blocks, not just its first prefill chunk; and keep this fraction of all KV blocks free
    # when admitting while other requests run (0: no watermark).
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    # Frontend admission control (vLLM's): refuse a request with HTTP 503 when the requests in flight plus its n
    # would exceed max_num_queued_reqs, or the prompt tokens waiting for a first token reach max_num_queued_tokens.
    max_num_queued_reqs: int | None = None  # None: no limit
    max_num_queued_tokens: int | None = None

    @property
    def scheduler_name(self) -> str:
        return self.scheduler_cls or self.scheduling_policy


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs: ``auto`` picks CUDA when available, else the CPU."""

    device: str = "auto"

    @property
    def device_type(self) -> str:
        if self.device != "auto":
            return self.device
        from vllite.platform import cuda_available

        return "cuda" if cuda_available() else "cpu"


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split across devices. vllite runs one model replica on one device, so every size is 1;
    the fields carry vLLM's names for the plugins that read them."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    #: Data parallel (``--data-parallel-size``): this many engine cores, each a whole replica with its own
    #: scheduler and KV cache, behind one client (``vllite.plugins.engine_proc.dp_client``).
    data_parallel_size: int = 1
    #: The rank of this engine core among them (set per engine by the client; 0 for the client's own copy).
    data_parallel_rank: int = 0
    #: Where the engine cores run: ``mp`` (local processes) or a registered backend such as ``ray``.
    data_parallel_backend: str = "mp"
    #: How requests are spread: ``load`` (least loaded) or ``prefix`` (same first prompt block, same engine).
    dp_routing: str = "load"
    #: Engines step in lockstep waves (stands in for MoE expert parallelism): idle ones run dummy steps.
    dp_lockstep: bool = False
    #: A dead engine's requests are re-submitted to a live one (continuing from the tokens they had) instead of
    #: failing.
    dp_retry: bool = False
    #: CPUs each engine reserves in its Ray placement-group bundle (the ray backend).
    dp_cpus_per_engine: float = 1.0
    #: A class (``pkg.mod:Class``) whose methods ``collective_rpc`` may call on every worker (vLLM's name).
    worker_extension_cls: str = ""

    @property
    def world_size(self) -> int:
        """Devices one model replica spans (tensor x pipeline parallel)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class ObservabilityConfig:
    """Stats and tracing switches.

    ``compute_nans_in_logits`` (``$VLLITE_COMPUTE_NANS_IN_LOGITS`` or vLLM's ``$VLLM_COMPUTE_NANS_IN_LOGITS``):
    the executor counts each request's NaN logits. ``enable_logging_iteration_details`` (vLLM's flag): the engine
    logs each step's context and generation requests and tokens, and its time.
    """

    log_stats: bool = False
    compute_nans_in_logits: bool = field(default_factory=lambda: compute_nans_in_logits_from_env())
    enable_logging_iteration_details: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine parts read, grouped as in vLLM's ``VllmConfig``; frozen once created."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    # n-gram speculative decoding (--speculative-config); None without it, which is what vLLM plugins test for.
    speculative_config: SpeculativeConfig | None = None
    # Structured outputs: the grammar backend and the whitespace defaults (vllite.structured_output).
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    executor: str = "default"
    logits_processors: list[Any] = field(default_factory=list)
    # Free-form settings for plugins, keyed by plugin name.
    plugin_config: dict[str, Any] = field(default_factory=dict)
    # The KV connector to build (--kv-transfer-config); None: no connector.
    kv_transfer_config: KVTransferConfig | None = None
    # LoRA adapters (--enable-lora); None: requests may not name one.
    lora_config: LoRAConfig | None = None
    # KV-cache events for KV-aware routers (--kv-events-config, vllite.kv_events); None: none published.
    kv_events_config: KVEventsConfig | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (for the engine-core process) with each importable class of ``logits_processors`` as its class
        path: the engine process then imports it when it loads its processors, after activating the vLLM
        compatibility layer, instead of while unpickling, when a class that imports ``vllm`` would fail."""
        state = dict(self.__dict__)
        state["logits_processors"] = [_as_class_path(item) for item in self.logits_processors]
        return state

    def with_limits(
        self, max_model_len: int, num_gpu_blocks: int | None = None, *, dtype: str | None = None
    ) -> EngineConfig:
        """A copy with the context length and KV block count the engine settled on, the token budget that
        follows from them, ``device_config.device`` resolved (``"auto"`` becomes ``"cuda"`` or ``"cpu"``) and, when
        given, the ``dtype`` that ``model_config.dtype`` resolved to; the engine's parts (scheduler, runner, plugins)
        read this copy. This config is unchanged. ``ValueError`` when the token budget cannot hold one full-length
        prompt without chunking."""
        budget = self._token_budget(max_model_len)
        model_config = dataclasses.replace(self.model_config, max_model_len=max_model_len)
        if dtype:
            model_config = dataclasses.replace(model_config, dtype=dtype)
        device_config = self.device_config
        if device_config.device == "auto":
            device_config = DeviceConfig(device=device_config.device_type)
        return dataclasses.replace(
            self,
            model_config=model_config,
            cache_config=dataclasses.replace(self.cache_config, num_gpu_blocks=num_gpu_blocks),
            scheduler_config=dataclasses.replace(self.scheduler_config, max_num_batched_tokens=budget),
            device_config=device_config,
        )

    def for_model(self, no_chunked_prefill: str | None, no_prefix_caching: str | None) -> EngineConfig:
        """A copy with chunked prefill and prefix caching turned off where the model rules them out (the
        arguments say why; ``None``: the model does not). The reasons are logged."""
        config = self
        if no_chunked_prefill and self.scheduler_config.enable_chunked_prefill:
            logger.info("Chunked prefill is off: %s", no_chunked_prefill)
            sched = dataclasses.replace(self.scheduler_config, enable_chunked_prefill=False)
            config = dataclasses.replace(config, scheduler_config=sched)
        if no_prefix_caching and self.cache_config.enable_prefix_caching:
            logger.info("Prefix caching is off: %s", no_prefix_caching)
            cache = dataclasses.replace(self.cache_config, enable_prefix_caching=False)
            config = dataclasses.replace(config, cache_config=cache)
        return config

    def _token_budget(self, max_model_len: int) -> int:
        """The per-step token budget for ``max_model_len``; ``ValueError`` when it cannot hold one full-length
        prompt without chunking."""
        sched = self.scheduler_config
        budget = sched.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not sched.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        if not sched.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({max_model_len}) with chunked "
                "prefill disabled, so long prompts could never be scheduled. Raise --max-num-batched-tokens, "
                "lower --max-model-len, or enable chunked prefill."
            )
        return budget


VllmConfig = EngineConfig


def _as_class_path(item: Any) -> Any:
    """``"module:Qualname"`` for a class reachable under that path (the same object), else ``item`` unchanged
    (strings, classes of ``__main__`` or defined inside functions)."""
    if not isinstance(item, type) or item.__module__ == "__main__":
        return item
    obj: Any = sys.modules.get(item.__module__)
    for attr in item.__qualname__.split("."):
        obj = getattr(obj, attr, None)
    return f"{item.__module__}:{item.__qualname__}" if obj is item else item


def compute_nans_in_logits_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``$VLLITE_COMPUTE_NANS_IN_LOGITS`` (else vLLM's ``$VLLM_COMPUTE_NANS_IN_LOGITS``) is 1 or true."""
    env = os.environ if env is None else env
    value = next((env[name] for name in COMPUTE_NANS_ENVS if name in env), "")
    return value.strip().lower() in ("1", "true")


def executor_name(executor: str, device: str) -> str:
    """The executor plugin to run: ``executor``, else the one a ``--device`` other than auto/cpu/cuda names."""
    return device if executor == "default" and device not in ("auto", "cpu", "cuda") else executor


def __getattr__(name: str) -> object:
    return moved_attribute(__name__, name)  # EngineArgs, now vllite.engine_args
