"""``EngineArgs``: the engine arguments users type (vLLM's names), the one argument parser built from them, and
``create_engine_config``, which checks them (:mod:`vllite.engine_args_checks`) and groups them into the frozen
``EngineConfig`` of :mod:`vllite.config`.

One parser, built from the ``EngineArgs`` fields (each field's ``metadata``: its help, choices, aliases, and a
``cli_type`` for values given as JSON or lists), serves both the CLI and ``EngineArgs.from_cli_args``. A model or
tokenizer given as a Hub id is resolved to its local snapshot folder here, once, in the frontend
(``vllite.plugins.hf_hub``), so the config names local folders only. What a component can tell only from the
grouped config it checks itself when the engine is created (``--async-scheduling``: ``vllite.sched.async_scheduler``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllite.config import (
    CONVERTS,
    DP_ROUTINGS,
    DTYPES,
    HASH_ALGOS,
    KV_CACHE_DTYPES,
    LOGPROBS_MODES,
    RUNNERS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
)
from vllite.engine_args_checks import cpu_kvcache_space_gib, kv_transfer_config, validate_engine_args
from vllite.lora.config import LORA_DTYPES, LoRAConfig
from vllite.speculative_config import SpeculativeConfig
from vllite.structured_output.params import StructuredOutputsConfig

if TYPE_CHECKING:
    from vllite.kv_events import KVEventsConfig


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


def _cli_type(annotation: Any) -> Any:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


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
    enable_return_routed_experts: bool = field(
        default=False,
        metadata=_help("MoE models: return each position's top-k expert ids per MoE layer with finished outputs."),
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
    disable_hybrid_kv_cache_manager: bool = field(
        default=False,
        metadata=_help("Keep every layer's KV for every block, also in models mixing sliding-window layers."),
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

    # ------------------------------------------------------------------ CLI
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Adds one flag per field (``--max-model-len`` for ``max_model_len``, ...) to ``parser``; returns it."""
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
        """The ``EngineArgs`` of parsed flags (``add_cli_args``); a JSON flag not given keeps its default."""
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
        validate_engine_args(self)
        cpu_space = cpu_kvcache_space_gib(self.cpu_kvcache_space)
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
            kv_transfer_config=kv_transfer_config(self.kv_transfer_config, self.kv_offload_size),
            speculative_config=SpeculativeConfig.resolve(self.speculative_config),
            structured_outputs_config=StructuredOutputsConfig.resolve(self.structured_outputs_config),
            lora_config=self._lora_config(),
            kv_events_config=self._kv_events_config(),
        )
        if self.max_model_len is not None:  # a token budget that the context length given rules out fails now
            config._token_budget(self.max_model_len)
        return config

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
            enable_return_routed_experts=self.enable_return_routed_experts,
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
            disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
            tool_call_estimator=self.tool_call_estimator,
            policy_args=dict(self.policy_args),
            stream_interval=self.stream_interval,
            scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
            watermark=float(self.watermark),
            max_num_queued_reqs=self.max_num_queued_reqs,
            max_num_queued_tokens=self.max_num_queued_tokens,
        )

    def _kv_events_config(self) -> KVEventsConfig | None:
        """``kv_events_config`` (a ``KVEventsConfig``, a dict or JSON text) checked; ``ValueError`` naming the field."""
        from vllite.kv_events import KVEventsConfig

        return KVEventsConfig.resolve(self.kv_events_config)
