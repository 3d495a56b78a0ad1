"""Engine configuration: ``EngineArgs`` (what users type) → ``EngineConfig`` (what the engine parts read).

``EngineConfig`` exposes the attribute paths vLLM plugins read from ``VllmConfig``
(``model_config.max_model_len``, ``model_config.get_vocab_size()``, ``model_config.runner_type``,
``cache_config.block_size``, ``scheduler_config.max_num_seqs``, ``parallel_config``, ``speculative_config``,
``device_config.device`` ...), and is also importable as ``VllmConfig``. One argument parser, built from the
``EngineArgs`` fields, serves both the CLI and ``EngineArgs.from_cli_args``.

Every config is frozen: it says what the user asked for and never changes. What the engine settles on at
start-up (the context length when the user gave none, the KV block count) is reported as an ``EngineInfo``;
the engine's own parts read a copy made with :meth:`EngineConfig.with_limits`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vllite.lora.config import LORA_DTYPES, LoRAConfig
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


def _json_dict(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass
class EngineArgs:
    """Engine arguments with vLLM's names; ``create_engine_config()`` validates and groups them."""

    model: str | None = field(default=None, metadata=_help("Local model folder or Hub id (default: the demo model)."))
    tokenizer: str | None = field(default=None, metadata=_help("Tokenizer folder or Hub id (default: the model)."))
    revision: str | None = field(default=None, metadata=_help("Hub model revision: a branch, tag or commit."))
    tokenizer_revision: str | None = field(default=None, metadata=_help("Hub tokenizer revision (default: revision)."))
    download_dir: str | None = field(default=None, metadata=_help("Hub downloads' cache (default: the HF cache)."))
    dtype: str = field(default="auto", metadata=_help("Model dtype.", choices=DTYPES))
    quantization: str | None = field(
        default=None, metadata=_help("Quantized weights: compressed-tensors, gptq (default: auto).", aliases=("-q",))
    )
    runner: str = field(
        default="auto", metadata=_help("generate, or pooling (embeddings, classification, scores).", choices=RUNNERS)
    )
    convert: str = field(
        default="auto", metadata=_help("Run a decoder checkpoint as an embed or classify model.", choices=CONVERTS)
    )
    pooler_config: dict[str, Any] | None = field(
        default=None,
        metadata=_help(
            'Pooler overrides as JSON: {"pooling_type": "MEAN", "normalize": true, ...}.', cli_type=_json_dict
        ),
    )
    max_model_len: int | None = field(default=None, metadata=_help("Context length (default: the model's)."))
    seed: int = field(default=0, metadata=_help("Seed for sampling without a per-request seed."))
    max_logprobs: int = field(
        default=20, metadata=_help("Most logprobs / prompt_logprobs a request may ask for (-1: the whole vocabulary).")
    )
    logprobs_mode: str = field(
        default="raw_logprobs",
        metadata=_help(
            "What sampled-token logprobs hold: raw_* from the model's logits, processed_* from the ones sampled from "
            "(after logits processors, penalties, temperature, top-k/top-p); *_logits unnormalized. Prompt logprobs "
            "are always raw logprobs.",
            choices=LOGPROBS_MODES,
        ),
    )
    trust_remote_code: bool = field(default=False, metadata=_help("Allow model code from the model folder."))
    enable_sleep_mode: bool = field(
        default=False,
        metadata=_help("Allow sleep (levels 1, 2) and wake_up: LLM.sleep(), the dev-mode /sleep and /wake_up routes."),
    )
    skip_tokenizer_init: bool = field(default=False, metadata=_help("Token ids in and out; no tokenizer."))
    enable_prompt_embeds: bool = field(
        default=False, metadata=_help("Accept prompt_embeds inputs (embedding rows instead of token ids).")
    )
    block_size: int = field(default=16, metadata=_help("Tokens per KV-cache block."))
    enable_prefix_caching: bool = field(default=True, metadata=_help("Reuse KV blocks of shared prefixes."))
    prefix_caching_hash_algo: str = field(
        default="sha256",
        metadata=_help("Block hash: sha256 (collision-resistant) or fast.", choices=HASH_ALGOS),
    )
    num_gpu_blocks_override: int | None = field(default=None, metadata=_help("Use exactly this many KV blocks."))
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_help(
            "KV-cache element type: auto (the model's dtype), or fp8 (= fp8_e4m3) / fp8_e5m2 with scale 1.0 "
            "(CPU only; 4x the blocks of float32 in the same space).",
            choices=KV_CACHE_DTYPES,
        ),
    )
    gpu_memory_utilization: float | None = field(
        default=None, metadata=_help("Fraction of GPU memory for the engine (default 0.9; CUDA only).")
    )
    cpu_kvcache_space: float | None = field(
        default=None, metadata=_help("KV-cache GiB on the CPU (default: $VLLITE_CPU_KVCACHE_SPACE or 4).")
    )
    max_num_seqs: int = field(default=128, metadata=_help("Most requests running at once."))
    max_num_batched_tokens: int | None = field(default=None, metadata=_help("Token budget per step."))
    enable_chunked_prefill: bool = field(default=True, metadata=_help("Split long prompts across steps."))
    long_prefill_token_threshold: int = field(default=0, metadata=_help("Cap on one prompt's tokens per step."))
    scheduler_reserve_full_isl: bool = field(
        default=True,
        metadata=_help("Admit a waiting request only if its whole prompt fits in free KV blocks, not one chunk."),
    )
    watermark: float = field(
        default=0.0,
        metadata=_help("Fraction of KV blocks kept free when admitting while others run, in [0, 1) (0: off)."),
    )
    max_num_queued_reqs: int | None = field(
        default=None,
        metadata=_help("Refuse a request (HTTP 503) when the requests in flight plus its n would exceed this."),
    )
    max_num_queued_tokens: int | None = field(
        default=None,
        metadata=_help("Refuse a request (HTTP 503) when prompt tokens waiting for a first token reach this."),
    )
    scheduler_cls: str | None = field(
        default=None, metadata=_help("Scheduler: a registered name (fcfs, priority, ...) or pkg.mod:Class.")
    )
    scheduling_policy: str = field(
        default="fcfs", metadata=_help("Scheduling policy when --scheduler-cls is not given.")
    )
    tool_call_estimator: str = field(default="utility", metadata=_help("Tool-call estimator (continuum)."))
    policy_args: dict[str, Any] = field(
        default_factory=dict,
        metadata=_help("Scheduler-policy settings as JSON, e.g. '{\"eta\": 1.5}'.", cli_type=_json_dict),
    )
    batch_queue_depth: int = field(default=1, metadata=_help("Batches in flight (pipelined step if > 1)."))
    stream_interval: int = field(
        default=1,
        metadata=_help("Hand a streamed request's outputs out every N tokens (and at its first and last token)."),
    )
    async_scheduling: bool = field(
        default=False,
        metadata=_help("Plan the next step while the current one runs (output placeholders)."),
    )
    logits_processors: list[Any] | None = field(
        default=None,
        metadata=_help("Extra logits processors: class paths, comma-separated (pkg.mod:A,pkg.mod:B).", cli_type=_names),
    )
    generation_config: str = field(
        default="auto",
        metadata=_help(
            "Default sampling parameters: 'auto' reads the model's generation_config.json, 'vllm' uses "
            "vllite's defaults, a folder path reads its generation_config.json."
        ),
    )
    device: str = field(default="auto", metadata=_help("Device: auto, cpu, cuda, or a registered executor's."))
    executor: str = field(default="default", metadata=_help("Executor plugin name."))
    disable_log_stats: bool = field(default=True, metadata=_help("Do not collect per-step stats."))
    enable_logging_iteration_details: bool = field(
        default=False, metadata=_help("Log each step's context/generation requests and tokens and its time.")
    )
    kv_transfer_config: Any = field(
        default=None,
        metadata=_help(
            'KV connector as JSON (vLLM\'s fields), e.g. \'{"kv_connector": "offload", "kv_role": "kv_both"}\'.',
            cli_type=_json_dict,
        ),
    )
    kv_offload_size: float | None = field(
        default=None,
        metadata=_help(
            "GiB of host memory for the 'offload' KV connector (a second KV tier keyed by block hash); "
            'shorthand for --kv-transfer-config \'{"kv_connector": "offload", ...}\', which overrides it.'
        ),
    )
    kv_events_config: Any = field(
        default=None,
        metadata=_help(
            "KV-cache events for KV-aware routers as JSON (vLLM's fields), e.g. '{\"enable_kv_cache_events\": true, "
            '"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}\'.',
            cli_type=_json_dict,
        ),
    )
    speculative_config: Any = field(
        default=None,
        metadata=_help(
            'Speculative decoding as JSON (vLLM\'s fields), e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\'.',
            cli_type=_json_dict,
        ),
    )
    structured_outputs_config: Any = field(
        default=None,
        metadata=_help(
            'Structured outputs as JSON (vLLM\'s fields), e.g. \'{"backend": "auto", "disable_any_whitespace": true}\' '
            "(backend: auto, xgrammar, guidance or another registered one).",
            cli_type=_json_dict,
        ),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=_help("Engine cores (replicas) behind one client; each runs in its own process.", aliases=("-dp",)),
    )
    data_parallel_backend: str = field(
        default="mp", metadata=_help("Where data-parallel engines run: mp (local processes) or ray.")
    )
    dp_routing: str = field(
        default="load",
        metadata=_help(
            "Data-parallel routing: load (least loaded engine) or prefix (requests sharing their first prompt "
            "block go to one engine).",
            choices=DP_ROUTINGS,
        ),
    )
    dp_lockstep: bool = field(
        default=False, metadata=_help("Data-parallel engines step in lockstep waves (as MoE expert parallelism).")
    )
    dp_retry: bool = field(
        default=False,
        metadata=_help(
            "Data parallel: re-submit a dead engine's requests to a live engine, continuing from the tokens they "
            "had, instead of failing them."
        ),
    )
    dp_cpus_per_engine: float = field(
        default=1.0, metadata=_help("CPUs each data-parallel engine reserves on its Ray node (the ray backend).")
    )
    worker_extension_cls: str = field(
        default="", metadata=_help("A class (pkg.mod:Class) whose methods collective_rpc may call on the workers.")
    )
    enable_lora: bool = field(default=False, metadata=_help("Serve LoRA adapters (lora_request, --lora-modules)."))
    max_loras: int = field(default=1, metadata=_help("Most distinct LoRA adapters in one step."))
    max_lora_rank: int = field(default=16, metadata=_help("Highest LoRA adapter rank served."))
    max_cpu_loras: int | None = field(
        default=None, metadata=_help("LoRA adapters kept loaded in host memory (default: max_loras).")
    )
    lora_dtype: str = field(
        default="auto", metadata=_help("LoRA compute dtype (auto: the model's).", choices=LORA_DTYPES)
    )
    plugin_config: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})

    # ------------------------------------------------------------------ CLI
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", True) is False:
                continue
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata.get("help")}
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            if "cli_type" in f.metadata:
                kwargs["type"] = f.metadata["cli_type"]
                kwargs["default"] = None
            elif f.type in ("bool",):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _cli_type(f.type)
            group.add_argument(*flags, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in vars(args).items() if k in names}
        for name in (
            "policy_args",
            "logits_processors",
            "kv_transfer_config",
            "kv_events_config",
            "speculative_config",
            "structured_outputs_config",
        ):
            if kwargs.get(name) is None:
                kwargs.pop(name, None)
        return cls(**kwargs)

    # ------------------------------------------------------------------ config
    def create_engine_config(self) -> EngineConfig:
        """Validates the arguments and groups them; raises ``ValueError`` naming the bad argument."""
        self._validate()
        cpu_space = self._cpu_kvcache_space_gib()
        config = EngineConfig(
            model_config=self._model_config(),
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                gpu_memory_utilization=0.9 if self.gpu_memory_utilization is None else self.gpu_memory_utilization,
                gpu_memory_utilization_given=self.gpu_memory_utilization is not None,
                cpu_kvcache_space_gib=cpu_space,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=self._scheduler_config(),
            device_config=DeviceConfig(device=self.device),
            parallel_config=ParallelConfig(
                data_parallel_size=self.data_parallel_size,
                data_parallel_backend=self.data_parallel_backend,
                dp_routing=self.dp_routing,
                dp_lockstep=self.dp_lockstep,
                dp_retry=self.dp_retry,
                dp_cpus_per_engine=self.dp_cpus_per_engine,
                worker_extension_cls=self.worker_extension_cls,
            ),
            observability_config=ObservabilityConfig(
                log_stats=not self.disable_log_stats,
                enable_logging_iteration_details=self.enable_logging_iteration_details,
            ),
            executor=self.executor,
            logits_processors=list(self.logits_processors or []),
            plugin_config=dict(self.plugin_config),
            kv_transfer_config=self._kv_transfer_config(),
            speculative_config=SpeculativeConfig.resolve(self.speculative_config),
            structured_outputs_config=StructuredOutputsConfig.resolve(self.structured_outputs_config),
            lora_config=self._lora_config(),
            kv_events_config=self._kv_events_config(),
        )
        self._check_combinations(config)
        return config

    def _cpu_kvcache_space_gib(self) -> float:
        """``cpu_kvcache_space``, else ``$VLLITE_CPU_KVCACHE_SPACE``, else 4 GiB; ``ValueError`` unless > 0."""
        cpu_space = self.cpu_kvcache_space
        if cpu_space is None:
            cpu_space = float(os.environ.get("VLLITE_CPU_KVCACHE_SPACE", "4"))
        if cpu_space <= 0:
            raise ValueError(f"cpu_kvcache_space (VLLITE_CPU_KVCACHE_SPACE) must be > 0 GiB, got {cpu_space}.")
        return cpu_space

    def _model_config(self) -> ModelConfig:
        """The model arguments; without ``model``, the demo model shipped in the package (also the tokenizer)."""
        from vllite.assets import default_model_path
        from vllite.plugins.hf_hub.resolve import resolve_model_paths  # Hub ids: downloaded once, here

        model, tokenizer = resolve_model_paths(self.model or default_model_path(), self.tokenizer, self)
        return ModelConfig(
            model=model,
            tokenizer=tokenizer,
            revision=self.revision,
            tokenizer_revision=self.tokenizer_revision or self.revision,
            dtype={"half": "float16", "float": "float32"}.get(self.dtype, self.dtype),
            quantization=self.quantization,
            max_model_len=self.max_model_len,
            seed=self.seed,
            max_logprobs=self.max_logprobs,
            logprobs_mode=self.logprobs_mode,
            trust_remote_code=self.trust_remote_code,
            skip_tokenizer_init=self.skip_tokenizer_init,
            generation_config=self.generation_config,
            runner=self.runner,
            convert=self.convert,
            pooler_config=self.pooler_config,
            enable_sleep_mode=self.enable_sleep_mode,
            enable_prompt_embeds=self.enable_prompt_embeds,
        )

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)

    def _scheduler_config(self) -> SchedulerConfig:
        """The scheduling arguments; ``policy_args`` copied, so that the config does not share the caller's dict."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            scheduler_cls=self.scheduler_cls,
            scheduling_policy=self.scheduling_policy,
            batch_queue_depth=self.batch_queue_depth,
            async_scheduling=self.async_scheduling,
            tool_call_estimator=self.tool_call_estimator,
            policy_args=dict(self.policy_args),
            stream_interval=self.stream_interval,
            scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
            watermark=float(self.watermark),
            max_num_queued_reqs=self.max_num_queued_reqs,
            max_num_queued_tokens=self.max_num_queued_tokens,
        )

    def _check_combinations(self, config: EngineConfig) -> None:
        """Checks, now rather than in the engine, what only the grouped config can tell: a token budget that the
        given ``max_model_len`` makes impossible, and ``--async-scheduling`` with a feature it does not serve yet
        (``ValueError`` naming both flags)."""
        if self.max_model_len is not None:
            config._token_budget(self.max_model_len)
        if self.async_scheduling:
            from vllite.sched.async_scheduler import check_async_scheduling

            check_async_scheduling(config)

    def _kv_events_config(self) -> KVEventsConfig | None:
        """``kv_events_config`` (a ``KVEventsConfig``, a dict or JSON text) checked; ``ValueError`` naming the field."""
        from vllite.kv_events import KVEventsConfig

        return KVEventsConfig.resolve(self.kv_events_config)

    def _kv_transfer_config(self) -> KVTransferConfig | None:
        """``kv_transfer_config`` (a ``KVTransferConfig``, a dict or JSON text) checked; ``ValueError`` naming the
        bad field."""
        from vllite.kv_connector.config import KVTransferConfig

        value = self.kv_transfer_config
        if value is None and self.kv_offload_size is not None:
            if not self.kv_offload_size > 0:
                raise ValueError(f"kv_offload_size must be > 0 GiB, got {self.kv_offload_size}.")
            extra = {"offload_size_gib": float(self.kv_offload_size)}
            return KVTransferConfig("offload", kv_role="kv_both", kv_connector_extra_config=extra)
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if not isinstance(value, (str, dict)):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}.")
        try:
            return KVTransferConfig.from_json(value)
        except TypeError as exc:  # a field of the wrong type the dataclass refused
            raise ValueError(f"kv_transfer_config is invalid: {exc}.") from None

    def _check_logprobs_mode(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode (--logprobs-mode) must be one of {', '.join(LOGPROBS_MODES)}, "
                f"got {self.logprobs_mode!r}."
            )
        if self.logprobs_mode.startswith("processed") and self.speculative_config is not None:
            raise ValueError(
                f"logprobs_mode={self.logprobs_mode} cannot be combined with speculative_config yet: the verification "
                "step returns raw logprobs only; use raw_logprobs or raw_logits."
            )

    def _check_admission_limits(self) -> None:
        """``max_num_queued_reqs`` / ``max_num_queued_tokens``: None (no limit) or >= 0; ``ValueError`` naming it."""
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} ({flag}) must be >= 0 (or unset: no limit), got {value!r}.")

    def _validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, "
                f"got {self.prefix_caching_hash_algo!r}."
            )
        if not self.dp_cpus_per_engine > 0:
            raise ValueError(f"dp_cpus_per_engine must be > 0, got {self.dp_cpus_per_engine}.")
        if self.dp_retry and self.dp_lockstep:
            raise ValueError(
                "dp_retry cannot be combined with dp_lockstep: lockstep engines share one collective, so a dead "
                "engine stops them all and there is no live engine to continue on."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype (kv_cache_dtype) must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}."
            )
        if self.kv_cache_dtype != "auto" and (self.kv_transfer_config is not None or self.kv_offload_size):
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype} cannot be combined with a KV connector "
                "(--kv-transfer-config / --kv-offload-size): the connectors copy float KV blocks, not fp8 ones."
            )
        self._check_logprobs_mode()
        if self.dp_routing not in DP_ROUTINGS:
            raise ValueError(f"dp_routing must be one of {', '.join(DP_ROUTINGS)}, got {self.dp_routing!r}.")
        for name in ("block_size", "max_num_seqs", "batch_queue_depth", "stream_interval", "data_parallel_size"):
            _positive(name, getattr(self, name))
        for name in ("max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}.")
        self._check_admission_limits()
        watermark = self.watermark
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a number in [0, 1) (a fraction of the KV blocks), got {watermark!r}.")
        if not isinstance(self.scheduler_reserve_full_isl, bool):
            raise ValueError(
                f"scheduler_reserve_full_isl must be True or False, got {self.scheduler_reserve_full_isl!r}."
            )
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.scheduler_cls is None:
            # Policies are plugins: any registered scheduler name is a valid --scheduling-policy.
            from vllite.plugin_manager import get_registry

            policies = get_registry("schedulers")
            if self.scheduling_policy not in policies:
                raise ValueError(
                    f"scheduling_policy must be a registered scheduler ({', '.join(sorted(policies))}), "
                    f"got {self.scheduling_policy!r}."
                )


def compute_nans_in_logits_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``$VLLITE_COMPUTE_NANS_IN_LOGITS`` (else vLLM's ``$VLLM_COMPUTE_NANS_IN_LOGITS``) is 1 or true."""
    env = os.environ if env is None else env
    value = next((env[name] for name in COMPUTE_NANS_ENVS if name in env), "")
    return value.strip().lower() in ("1", "true")


def executor_name(executor: str, device: str) -> str:
    """The executor plugin to run: ``executor``, else the one a ``--device`` other than auto/cpu/cuda names."""
    return device if executor == "default" and device not in ("auto", "cpu", "cuda") else executor


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _cli_type(annotation: Any) -> Any:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str
