"""``DefaultExecutor``: runs a transformers model in this process, on the CPU or one CUDA device.

KV-cache sizing (issue 3's rules): ``num_gpu_blocks_override`` wins; on the CPU the budget is
``cache_config.cpu_kvcache_space_gib`` (else ``VLLITE_CPU_KVCACHE_SPACE``, else 4 GiB); on CUDA it is
``gpu_memory_utilization x total`` (this engine's share of the device, as vLLM's flag) minus what the engine took
since it started (weights, CUDA workspaces) and the peak activations of a profiling forward pass, and never more
than is free; memory other processes hold is theirs, not this engine's. One sequence of ``max_model_len`` tokens
must fit: when the user gave ``--max-model-len`` a cache too small is a ``KVCacheMemoryError`` that says what to
change; otherwise the context shrinks to what fits, with a warning naming both lengths.

Sleep: level 1 moves the weights to the CPU and frees the KV cache; level 2 frees both (weights are reloaded
from the model folder on wake-up). ``wake_up(["weights"])`` / ``wake_up(["kv_cache"])`` restore one part.

KV connector: with ``kv_transfer_config`` set, the WORKER role of the configured connector is built once, when the
KV cache is first allocated, and registered with every allocation (``register_kv_caches``); the model runner then
runs each step through it. It is shut down with the executor.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import msgspec
import torch

from vllite.exceptions import (
    AttentionRoutingError,
    DeviceUnavailableError,
    ExecutorAsleepError,
    KVCacheMemoryError,
    ModelLoadError,
)
from vllite.executor import Executor, KVCacheInfo, ModelInfo
from vllite.kv_connector.base import KVConnectorBase, KVConnectorRole
from vllite.lora import LoRARequest
from vllite.model_files import load_hf_config
from vllite.platform.cpu_threads import CpuThreadPlan
from vllite.plugins.transformers_executor.architecture_guard import architecture_name, check_architecture
from vllite.plugins.transformers_executor.kv_cache_layout import kv_cache_layout
from vllite.plugins.transformers_executor.kv_cache_sizing import (
    GiB,
    cpu_kvcache_space_bytes,
    cuda_kvcache_space_bytes,
    determine_num_blocks,
    kv_cache_bytes_per_token,
)
from vllite.plugins.transformers_executor.lora import LoRAModelManager
from vllite.plugins.transformers_executor.model_loader import (
    load_model,
    model_spec,
    resolve_dtype,
    uniform_sliding_window,
)
from vllite.plugins.transformers_executor.model_runner import ModelRunner
from vllite.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def resolve_device(device_type: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; a clear error when CUDA is asked for but unavailable."""
    device = torch.device(device_type)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError("--device cuda was requested but torch sees no CUDA device.")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"The default executor runs on cpu or cuda, not {device_type!r}.")
    return device


def _check_kv_cache_dtype(kv_cache_dtype: str, device_type: str) -> None:
    """Refuses at start-up an fp8 KV cache where it is not implemented: anywhere but the CPU (the Triton kernels
    read no fp8)."""
    device = torch.device(device_type).type
    if kv_cache_dtype != "auto" and device != "cpu":
        raise DeviceUnavailableError(
            f"--kv-cache-dtype {kv_cache_dtype} is implemented on the CPU path only, not on {device}; "
            "use --kv-cache-dtype auto (the model's dtype) there."
        )


def _warn_gpu_memory_utilization_ignored(data_parallel_rank: int) -> None:
    """Says once per run (data-parallel engine 0 speaks for all) that the CPU sizes its KV cache otherwise."""
    if data_parallel_rank == 0:
        logger.warning(
            "--gpu-memory-utilization is ignored on the CPU: the KV cache takes --cpu-kvcache-space GiB "
            "(default: $VLLITE_CPU_KVCACHE_SPACE or 4)."
        )


class DefaultExecutor(Executor):
    """Loads the model folder with transformers and runs it through vllite's paged attention."""

    #: Forces a device regardless of ``--device`` (the ``cpu`` / ``cuda`` registered names set it).
    device_override: str | None = None

    def _init_executor(self) -> ModelInfo:
        mc = self.config.model_config
        device_type = self.device_override or self.config.device_config.device_type
        _check_kv_cache_dtype(self.config.cache_config.kv_cache_dtype, device_type)
        self.device = resolve_device(device_type)
        if self.device.type == "cpu" and self.config.cache_config.gpu_memory_utilization_given:
            _warn_gpu_memory_utilization_ignored(self.config.parallel_config.data_parallel_rank)
        hf_config = mc.hf_config or load_hf_config(mc.model, trust_remote_code=mc.trust_remote_code)
        self.hf_config = hf_config
        check_architecture(hf_config)  # before the weights load: refused, never run wrongly
        self.spec = model_spec(hf_config)
        max_model_len = self._max_model_len(mc.max_model_len, self.spec.max_position_embeddings)
        self.dtype = resolve_dtype(mc.dtype, hf_config, self.device)  # resolved once; reported in ModelInfo.dtype
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._cuda_free_at_start = torch.cuda.mem_get_info(self.device)[0]
        # The model's own limit may later shrink to what the KV cache holds; a length the user asked for may not.
        self._may_shrink_context = mc.max_model_len is None
        # The runner (and the logits processors it builds) read the context length this executor settled on.
        self.config = self.config.with_limits(max_model_len, dtype=str(self.dtype).removeprefix("torch."))
        self._num_blocks: int | None = None
        self._kv_connector: KVConnectorBase | None = None
        eos = getattr(getattr(hf_config, "text_config", None) or hf_config, "eos_token_id", None)
        hybrid = not self.config.scheduler_config.disable_hybrid_kv_cache_manager
        self.layout = kv_cache_layout(hf_config, self.spec.num_layers, hybrid=hybrid and mc.runner_type != "pooling")
        info = ModelInfo(
            max_model_len=max_model_len,
            vocab_size=self.spec.vocab_size,
            eos_token_ids=tuple(eos if isinstance(eos, (list, tuple)) else () if eos is None else (eos,)),
            sliding_window=uniform_sliding_window(hf_config),
            kv_cache_groups=self.layout.windows,
            dtype=str(self.dtype).removeprefix("torch."),
        )
        if mc.runner_type == "pooling":
            return self._init_pooling_runner(info)
        model = load_model(
            str(mc.model),
            hf_config,
            self.dtype,
            self.device,
            trust_remote_code=mc.trust_remote_code,
            quantization=mc.quantization,
        )
        self.runner = ModelRunner(self.config, model, self.spec, self.device, self.dtype, layout=self.layout)
        self._probe_architecture()
        return info

    def _probe_architecture(self) -> None:
        """Runs a few dummy tokens through the model before serving: an architecture vllite would run wrongly (an
        attention argument it does not implement, attention it does not see) is refused now, with a
        ``ModelLoadError``, instead of failing a running engine or giving wrong tokens."""
        try:
            self.runner.probe_forward()
        except (AttentionRoutingError, RuntimeError) as exc:
            raise ModelLoadError(
                f"{architecture_name(self.hf_config)} cannot run on vllite: {exc} Refused at start-up rather than "
                "giving wrong tokens."
            ) from exc

    def _init_pooling_runner(self, info: ModelInfo) -> ModelInfo:
        """Loads the model as a pooling model (``--runner pooling``) and builds its runner."""
        from vllite.plugins.transformers_executor.pooling import (
            PoolingModelRunner,
            load_pooling_model,
            resolve_pooling_setup,
        )

        mc = self.config.model_config
        if self.config.logits_processors:
            raise ValueError("Pooling models do not sample, so they take no --logits-processors.")
        if self.config.speculative_config is not None or self.config.scheduler_config.async_scheduling:
            raise ValueError("Pooling models finish with their prompt: --speculative-config and --async-scheduling "
                             "do not apply to them.")  # fmt: skip
        if self.config.lora_config is not None:
            raise ValueError("LoRA adapters on pooling models are not supported yet; start without --enable-lora.")
        setup = resolve_pooling_setup(str(mc.model), self.hf_config, mc.convert, mc.pooler_config)
        loaded = load_pooling_model(
            str(mc.model), self.hf_config, setup, self.dtype, self.device, trust_remote_code=mc.trust_remote_code
        )
        self.runner = PoolingModelRunner(self.config, loaded, self.spec, self.device, self.dtype)
        return msgspec.structs.replace(
            info,
            supported_tasks=setup.supported_tasks,
            no_chunked_prefill=loaded.no_chunked_prefill,
            no_prefix_caching=loaded.no_prefix_caching,
        )

    @staticmethod
    def _max_model_len(requested: int | None, max_positions: int | None) -> int:
        if requested is None:
            if max_positions is None:
                raise ModelLoadError("The model config has no max_position_embeddings; pass --max-model-len.")
            return int(max_positions)
        if max_positions is not None and requested > max_positions:
            raise ValueError(
                f"max_model_len={requested} exceeds the model's max_position_embeddings={max_positions}; "
                "lower --max-model-len."
            )
        return int(requested)

    # ------------------------------------------------------------------ KV cache
    def initialize_kv_cache(self) -> KVCacheInfo:
        """Sizes the KV cache from the memory budget (or ``num_gpu_blocks_override``) and allocates it."""
        cc = self.config.cache_config
        max_model_len = self.model_info.max_model_len
        s = self.spec
        dtype_bytes = torch.empty((), dtype=self.runner.kv_cache_dtype).element_size()
        # A block holds the KV of the layout's tensor slots (all layers, or one group's share of them); a position
        # of a sequence takes one block per group, so the sizing below counts groups' blocks together.
        slots, groups = self.runner.layout.num_slots, self.runner.layout.num_groups
        bytes_per_token = kv_cache_bytes_per_token(slots, s.num_kv_heads, s.head_dim, dtype_bytes, s.v_head_dim)
        if cc.num_gpu_blocks_override is not None:
            num_blocks = int(cc.num_gpu_blocks_override)
            max_model_len = self._fit_context_to_override(num_blocks, max_model_len, groups)
        else:
            num_positions, max_model_len = determine_num_blocks(
                self._available_kv_bytes(),
                bytes_per_token * groups,
                cc.block_size,
                max_model_len,
                allow_shrink=self._may_shrink_context,
                device=self.device.type,
            )
            # Take at most twice what max_num_seqs full-length sequences can use (the extra half keeps finished
            # prefixes cached), not the whole budget: CPU memory is shared with everything else, and on a GPU a
            # small model's budget would be tens of millions of blocks, each a Python object of the block pool.
            blocks_per_seq = -(-max_model_len // cc.block_size)
            num_positions = min(num_positions, 2 * self.config.scheduler_config.max_num_seqs * blocks_per_seq + 1)
            num_blocks = (num_positions - 1) * groups + 1
        self.runner.allocate_kv_cache(num_blocks)
        self._num_blocks = num_blocks
        self._attach_kv_connector()
        num_bytes = num_blocks * cc.block_size * bytes_per_token  # the engine core logs it with the block count
        return KVCacheInfo(num_blocks=num_blocks, max_model_len=max_model_len, num_bytes=num_bytes)

    def _attach_kv_connector(self) -> None:
        """Builds the worker-role KV connector (once) and registers the freshly allocated KV cache with it."""
        kv_transfer_config = getattr(self.config, "kv_transfer_config", None)
        if kv_transfer_config is None:
            return
        if self._kv_connector is None:
            from vllite.kv_connector.factory import create_connector

            self._kv_connector = create_connector(self.config, KVConnectorRole.WORKER, kv_transfer_config)
        self.runner.attach_kv_connector(self._kv_connector)

    def _fit_context_to_override(self, num_blocks: int, max_model_len: int, groups: int = 1) -> int:
        """The context length ``num_blocks`` blocks (block 0 is the null block) can hold one sequence of (a sequence
        takes a block per position in each of ``groups`` KV-cache groups): the model's own, shrunk with a warning
        when the user gave no max_model_len; a user-fixed max_model_len that does not fit is a
        ``KVCacheMemoryError`` (a request of that length could never run)."""
        block_size = self.config.cache_config.block_size
        capacity = (num_blocks - 1) // groups * block_size
        if capacity >= max_model_len:
            return max_model_len
        if not self._may_shrink_context or capacity <= 0:
            raise KVCacheMemoryError(
                f"num_gpu_blocks_override={num_blocks} blocks of {block_size} tokens hold {max(capacity, 0)} tokens, "
                f"less than one sequence of max_model_len={max_model_len}: raise --num-gpu-blocks-override to at "
                f"least {-(-max_model_len // block_size) * groups + 1} or lower --max-model-len to at most "
                f"{max(capacity, 0)}."
            )
        logger.warning(
            "num_gpu_blocks_override=%d cannot hold one sequence of the model's %d tokens: the context shrinks to %d.",
            num_blocks,
            max_model_len,
            capacity,
        )
        return capacity

    def _available_kv_bytes(self) -> int:
        cc = self.config.cache_config
        if self.device.type == "cpu":
            return cpu_kvcache_space_bytes(cc.cpu_kvcache_space_gib)
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        budget = self.config.scheduler_config.max_num_batched_tokens or 2048
        self.runner.profile_run(budget)
        torch.cuda.synchronize(self.device)
        peak_activations = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        start = self._cuda_free_at_start
        budget = cuda_kvcache_space_bytes(total, free, start, peak_activations, cc.gpu_memory_utilization)
        logger.info(
            "CUDA KV-cache budget %.2f GiB: %.0f%% of %.2f GiB, less %.2f GiB taken by the engine and %.2f GiB of "
            "peak activations (%.2f GiB free)",
            budget / GiB,
            cc.gpu_memory_utilization * 100,
            total / GiB,
            max(0, start - free) / GiB,
            peak_activations / GiB,
            free / GiB,
        )
        return budget

    # ------------------------------------------------------------------ steps
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step. Raises on a failed forward pass (the engine turns it into an error for the caller);
        the requests of that step should then be aborted. While asleep only a step that schedules no tokens runs
        (the engine's way to hand over requests that ended meanwhile, e.g. aborted in the queue): it updates the
        runner's request state and touches neither the weights nor the KV cache."""
        if self.is_sleeping and scheduler_output.total_num_scheduled_tokens > 0:
            raise ExecutorAsleepError("The executor is sleeping; call wake_up() before executing the model.")
        return self.runner.execute_model(scheduler_output)

    # ------------------------------------------------------------------ LoRA adapters (engine-core utilities)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._lora().add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove_adapter(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora().list_adapters()

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora().pin_adapter(lora_id)

    def _lora(self) -> LoRAModelManager:
        if self.runner.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True (--enable-lora).")
        return self.runner.lora

    # ------------------------------------------------------------------ sleep / shutdown
    def _sleep(self, level: int) -> None:
        if level == 2 and hasattr(self.runner, "pooler"):
            raise ValueError("A pooling model sleeps at level 1 only (its weights move to the CPU memory).")
        self.runner.free_kv_cache()
        model = self.runner.model
        if level == 1:
            model.to("cpu")
        else:
            self.runner.model = None  # type: ignore[assignment]
            self.runner.fused_decoder = None  # it holds the weights too
            del model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _wake_up(self, tags: list[str] | None) -> None:
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"Unknown wake_up tags {sorted(unknown)}; known: weights, kv_cache.")
        if "weights" in tags:
            if self.runner.model is None:
                mc = self.config.model_config
                self.runner.replace_model(
                    load_model(
                        str(mc.model),
                        self.hf_config,
                        self.dtype,
                        self.device,
                        trust_remote_code=mc.trust_remote_code,
                        quantization=mc.quantization,
                    )
                )
            else:
                self.runner.model.to(self.device)
        if "kv_cache" in tags and self._num_blocks is not None and not self.runner.kv_caches:
            self.runner.allocate_kv_cache(self._num_blocks)
            self._attach_kv_connector()
        weights_ready = self.runner.model is not None and self._model_on_device()
        kv_ready = self._num_blocks is None or bool(self.runner.kv_caches)
        if weights_ready and kv_ready:
            self._sleep_level = 0

    def _model_on_device(self) -> bool:
        param = next(self.runner.model.parameters(), None)
        return param is None or param.device == self.device

    # ------------------------------------------------------------------ profiling and worker RPC
    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Starts or stops ``torch.profiler`` in this process (see :mod:`.profiler`); a stop writes the trace."""
        from vllite.plugins.transformers_executor.profiler import TorchProfiler

        profiler = self.__dict__.get("_profiler")
        if profiler is None:
            rank = self.config.parallel_config.data_parallel_rank
            profiler = self.__dict__["_profiler"] = TorchProfiler(self.device.type, f"vllite-engine{rank}")
        if is_start:
            profiler.start(profile_prefix)
        else:
            profiler.stop()

    @property
    def model_runner(self) -> Any:
        """The model runner, under vLLM's worker attribute name (what worker extensions reach for)."""
        return self.runner

    def govern_inprocess_steps(self, engine_core: Any) -> None:
        """Pins torch's threads (the plan of ``VLLITE_CPU_OMP_THREADS_BIND``, see ``vllite.platform.cpu_threads``)
        while the caller's thread steps ``engine_core``, and governs them after each step (:mod:`.cpu_governor`)."""
        from vllite.platform.cpu_threads import resolve_plan
        from vllite.plugins.transformers_executor.cpu_governor import govern_engine_core

        govern_engine_core(engine_core, resolve_plan(), caller_thread=True)

    def govern_process_steps(self, engine_core: Any, plan: CpuThreadPlan) -> None:
        """Pins torch's threads to ``plan`` on the engine process's busy-loop thread for good, governs them after
        each step, and moves the process's other threads (I/O, ZMQ) onto the CPUs the plan reserves."""
        from vllite.plugins.transformers_executor.cpu_governor import govern_engine_core

        govern_engine_core(engine_core, plan).place_others()

    def shutdown(self) -> None:
        """Frees the KV cache and the model. Idempotent."""
        profiler = self.__dict__.pop("_profiler", None)
        if profiler is not None:
            profiler.close()  # a trace still running is written, not lost
        runner = getattr(self, "runner", None)
        if runner is None:
            return
        connector, self._kv_connector = self._kv_connector, None
        if connector is not None:
            try:
                connector.shutdown()
            except Exception:  # shutting down must free the model and the cache whatever the connector does
                logger.exception("KV connector %s failed to shut down", type(connector).__name__)
        runner.free_kv_cache()
        runner.model = None
        self.runner = None  # type: ignore[assignment]
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class CPUExecutor(DefaultExecutor):
    """The default executor pinned to the CPU (registered as ``cpu``)."""

    device_override = "cpu"


class CUDAExecutor(DefaultExecutor):
    """The default executor pinned to the current CUDA device (registered as ``cuda``)."""

    device_override = "cuda"
