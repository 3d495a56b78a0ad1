"""The model runner: applies each ``SchedulerOutput`` to the persistent batch, runs the model, samples.

One step:

1. ``_update_states``: drop finished requests; take preempted and unscheduled ones out of the batch (their
   state is kept for a later resume); record new requests; apply the block and progress diffs of cached ones;
   add (re-)scheduled requests into free rows; condense; hand the ``BatchUpdate`` to the logits processors.
2. ``_prepare_inputs``: the packed batch (``input_ids``/``position_ids`` of shape ``[1, num_tokens]``) and the
   attention metadata (slot mapping, block tables, query start locations, sequence lengths).
3. forward under :func:`~vllite.plugins.transformers_executor.attention.forward_context`, keeping only the logits
   needed: the last scheduled token of every request, plus the prompt positions whose prompt logprobs are asked for.
4. sample every row; keep the token only for requests whose known tokens are all computed after this step
   (a prefill chunk that does not end the prompt returns ``[]``), and return logprobs / prompt logprobs.

Prompt logprobs: see :mod:`vllite.plugins.transformers_executor.prompt_logprobs`.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import numpy as np
import torch

from vllite.config import EngineConfig
from vllite.exceptions import AttentionRoutingError, BatchStateError, KVCacheNotAllocatedError, ModelLoadError
from vllite.kernels.kv_cache_dtype import is_fp8, kv_cache_torch_dtype
from vllite.kv_connector.base import KVConnectorBase
from vllite.lora import LoRARequest
from vllite.plugins.transformers_executor.attention import AttentionMetadata, forward_context, kv_layer_name
from vllite.plugins.transformers_executor.fused_decode import FusedDecoder, build_fused_decoder
from vllite.plugins.transformers_executor.huge_pages import zeros_on_huge_pages
from vllite.plugins.transformers_executor.input_batch import CachedRequestState, InputBatch
from vllite.plugins.transformers_executor.kv_cache_layout import KVCacheLayout
from vllite.plugins.transformers_executor.kv_connector_step import execute_with_connector
from vllite.plugins.transformers_executor.lora import LoRAModelManager
from vllite.plugins.transformers_executor.model_loader import ModelSpec
from vllite.plugins.transformers_executor.prompt_embeds import PromptEmbedsInputs
from vllite.plugins.transformers_executor.prompt_logprobs import compute_prompt_logprobs, plan_prompt_logprobs
from vllite.plugins.transformers_executor.routed_experts import RoutedExpertsRecorder
from vllite.plugins.transformers_executor.sampler import (
    Sampler,
    SamplingMetadata,
    count_nans_in_logits,
    draw_uniform_,
)
from vllite.plugins.transformers_executor.sampling_inputs import SamplingInputs
from vllite.plugins.transformers_executor.spec_decode.decoder import NgramSpecDecoder
from vllite.plugins.transformers_executor.step_buffers import StepBuffers, prepare_inputs
from vllite.protocol import LogprobsLists
from vllite.sampling_params import SamplingType
from vllite.sched.output import ModelRunnerOutput, SchedulerOutput
from vllite.structured_output.bitmask import batch_token_mask

logger = logging.getLogger(__name__)


def _build_logitsprocs(config: EngineConfig, device: torch.device) -> Any:
    try:
        from vllite.logits_processor import build_logitsprocs
    except ImportError:
        from vllite.logits_processor.loader import build_logitsprocs
    return build_logitsprocs(config, device, device.type == "cuda")


class ModelRunner:
    """Owns the persistent batch, the KV cache tensors and the sampler for one loaded model."""

    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        spec: ModelSpec,
        device: torch.device,
        dtype: torch.dtype,
        *,
        layout: KVCacheLayout | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.spec = spec
        # How the layers share KV tensors, and the block tables a request has (one per KV-cache group).
        self.layout = layout or KVCacheLayout.plain(spec.num_layers)
        self.device = device
        self.dtype = dtype
        # --kv-cache-dtype: the model's dtype (auto) or fp8 with per-layer (k_scale, v_scale), vLLM's default 1.0
        # (scales stored in a checkpoint are not read).
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache_config.kv_cache_dtype, dtype)
        self.kv_scales: list[tuple[float, float]] = (
            [(1.0, 1.0)] * spec.num_layers if is_fp8(self.kv_cache_dtype) else []
        )
        self.block_size = config.cache_config.block_size
        # The executor resolves max_model_len (EngineConfig.with_limits) before it builds the runner.
        assert config.model_config.max_model_len is not None
        self.max_model_len = int(config.model_config.max_model_len)
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.vocab_size = self._output_vocab_size(model, spec)
        max_blocks = -(-self.max_model_len // self.block_size) * self.layout.num_groups  # groups interleaved
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, max_blocks, self.vocab_size)
        self.requests: dict[str, CachedRequestState] = {}
        self.logitsprocs = _build_logitsprocs(config, device)
        self.sampler = Sampler(config.model_config.logprobs_mode)
        self.compute_nans_in_logits = config.observability_config.compute_nans_in_logits
        self.default_generator = torch.Generator(device=device)
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            from vllite.kernels.cpu_decode import decode_kernel

            decode_kernel()  # a first build (about half a minute, once per machine) happens at start-up, not mid-step
        self.default_generator.manual_seed(config.model_config.seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_layers: list[torch.Tensor] = []  # per layer [2, num_blocks, block_size, heads, dim]
        self._kv_buffer: torch.Tensor | None = None
        self._v_buffer: torch.Tensor | None = None  # the values, when their head size is not the keys'
        self.kv_connector: KVConnectorBase | None = None  # the worker role, when --kv-transfer-config is set
        self._accepts_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # Per batch composition (InputBatch.version): the row index map and whether prompt logprobs are wanted.
        self._index_version = self._prompt_lp_version = -1
        self._index_map: dict[str, int] = {}
        self._prompt_lp = False
        self.buffers = StepBuffers(self.max_num_reqs)
        spec_config = config.speculative_config  # n-gram speculative decoding (spec_decode/decoder.py)
        self.spec_decoder = NgramSpecDecoder(spec_config, self.max_model_len) if spec_config is not None else None
        self.sampling_inputs = SamplingInputs(
            self.input_batch, self.vocab_size, device, self.default_generator, self.logitsprocs
        )
        self.lora: LoRAModelManager | None = None  # LoRA adapters (--enable-lora), applied inside the model
        if config.lora_config is not None:
            self.lora = LoRAModelManager(model, config.lora_config, device, dtype)
        self.routed_experts: RoutedExpertsRecorder | None = None  # --enable-return-routed-experts
        if config.model_config.enable_return_routed_experts:
            self.routed_experts = RoutedExpertsRecorder(model, type(model).__name__)
        self.fused_decoder = self._build_fused_decoder(model)
        self.prompt_embeds = PromptEmbedsInputs(model)  # inputs_embeds of steps with prompt_embeds positions

    def _build_fused_decoder(self, model: torch.nn.Module) -> FusedDecoder | None:
        """The compiled decode step (fused_decode.py) for a CPU model without LoRA whose cache is in its dtype."""
        if self.device.type != "cpu" or self.lora is not None or self.kv_cache_dtype != self.dtype:
            return None
        if self.layout.num_groups > 1 or self.routed_experts is not None:
            return None
        return build_fused_decoder(model, self.dtype, self.max_model_len)

    @staticmethod
    def _output_vocab_size(model: torch.nn.Module, spec: ModelSpec) -> int:
        get_output_embeddings = getattr(model, "get_output_embeddings", None)
        head = get_output_embeddings() if get_output_embeddings is not None else None
        weight = getattr(head, "weight", None)
        return int(weight.shape[0]) if weight is not None else spec.vocab_size

    # ------------------------------------------------------------------ KV cache
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocates ``num_blocks`` blocks per layer as one zeroed buffer with per-layer key/value views; keys and
        values of different head sizes (multi-head latent attention) get one buffer each, and no per-layer KV
        tensor for a KV connector."""
        s, slots = self.spec, self.layout.layer_slot  # layer i uses tensor slot slots[i] (kv_cache_layout.py)
        self.free_kv_cache()
        if self.routed_experts is not None:
            self.routed_experts.allocate(num_blocks * self.block_size)
        n = self.layout.num_slots
        if s.v_head_dim != s.head_dim:
            shapes = [(n, num_blocks, self.block_size, s.num_kv_heads, d) for d in (s.head_dim, s.v_head_dim)]
            self._kv_buffer, self._v_buffer = keys, values = self._zeros(shapes[0]), self._zeros(shapes[1])
            self.kv_caches = [(keys[slots[i]], values[slots[i]]) for i in range(s.num_layers)]
            return
        self._kv_buffer = self._zeros((n, 2, num_blocks, self.block_size, s.num_kv_heads, s.head_dim))
        self.kv_caches = [(self._kv_buffer[slots[i], 0], self._kv_buffer[slots[i], 1]) for i in range(s.num_layers)]
        if self.layout.num_groups == 1:
            self.kv_layers = [self._kv_buffer[i] for i in range(s.num_layers)]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            return zeros_on_huge_pages(shape, self.kv_cache_dtype)
        return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

    def free_kv_cache(self) -> None:
        self.kv_caches = []
        self.kv_layers = []
        self._kv_buffer = self._v_buffer = None

    def attach_kv_connector(self, connector: KVConnectorBase) -> None:
        """Runs every later step through ``connector`` (worker role) and registers the allocated KV cache with it
        (``{kv_layer_name(i): layer i's KV}``); call again after the cache is re-allocated."""
        if not self.kv_layers:
            raise ModelLoadError(
                "A KV connector moves each layer's keys and values as one tensor through one block table, which a "
                "model whose keys and values have different head sizes (multi-head latent attention), or whose "
                "sliding-window and full-attention layers keep their own block tables, does not have: drop "
                "--kv-transfer-config (and --kv-offload-size) for this model, or for the latter pass "
                "--disable-hybrid-kv-cache-manager."
            )
        self.kv_connector = connector
        connector.register_kv_caches({kv_layer_name(i): layer for i, layer in enumerate(self.kv_layers)})

    @property
    def num_kv_blocks(self) -> int:
        return 0 if not self.kv_caches else int(self.kv_caches[0][0].shape[0])

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one scheduled step and returns the sampled tokens (see the module docstring); with a KV connector,
        between its per-step calls (:mod:`~vllite.plugins.transformers_executor.kv_connector_step`)."""
        recorder = self.routed_experts
        if recorder is not None:
            recorder.begin_step()
        if self.kv_connector is None:
            output = self._execute_model(scheduler_output)
        else:
            output = execute_with_connector(self.kv_connector, scheduler_output, self._execute_model)
        if recorder is not None:
            new = {r.req_id for r in scheduler_output.scheduled_new_reqs}
            batch, groups = self.input_batch, self.layout.num_groups
            output.routed_experts = recorder.collect(new, batch.block_table, self.block_size, groups)
        return output

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0 or self.input_batch.num_reqs == 0:
            return ModelRunnerOutput.empty()
        if not self.kv_caches:
            raise KVCacheNotAllocatedError(
                "The KV cache is not allocated (call initialize_kv_cache, or wake_up after sleep)."
            )
        batch = self.input_batch
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids
        scheduled = scheduler_output.num_scheduled_tokens
        num_scheduled = np.fromiter(map(scheduled.__getitem__, req_ids), dtype=np.int64, count=num_reqs)
        spec = self.spec_decoder
        num_drafts = spec.write_drafts(batch, scheduler_output.scheduled_spec_decode_tokens, req_ids) if spec else None
        input_ids, positions, metadata = self._prepare_inputs(num_scheduled, num_drafts)
        if self.lora is not None:
            self._prepare_lora(self.lora, num_scheduled)
        seq_lens = batch.num_computed_tokens[:num_reqs] + num_scheduled
        samples = seq_lens >= batch.num_tokens[:num_reqs]

        if num_drafts is not None:  # keep the logits of every draft position (and the one before the drafts)
            assert spec is not None
            draft_indices, first_rows = spec.logits_indices(metadata.query_start_loc.cpu(), num_drafts)
            logits_indices = torch.from_numpy(draft_indices).to(self.device)
        else:
            logits_indices = metadata.query_start_loc[1:].to(torch.int64) - 1
        prompt_plan = None
        if self._wants_prompt_logprobs(batch):
            prompt_plan = plan_prompt_logprobs(
                self.requests, req_ids, num_scheduled.tolist(), metadata.query_start_loc.tolist(), self.vocab_size
            )
        if prompt_plan:
            extra = torch.cat([torch.arange(c.lo, c.hi) for c in prompt_plan]).to(self.device)
            logits_indices = torch.cat([logits_indices, extra])
        inputs_embeds = self.prompt_embeds.build(batch, num_scheduled, input_ids)
        logits = self._forward(input_ids, positions, metadata, logits_indices, inputs_embeds)
        if num_drafts is not None:
            assert spec is not None
            return spec.finish_step(
                self, logits, first_rows, num_drafts, samples, req_ids, prompt_plan, scheduler_output
            )

        nans = count_nans_in_logits(logits[:num_reqs], req_ids) if self.compute_nans_in_logits else None
        sampling_md = self._sampling_metadata(samples)
        token_mask = None
        grammar_output = scheduler_output.grammar_output
        if grammar_output is not None:  # structured outputs: the bitmask, waited for when the sampler needs it
            token_mask = functools.partial(batch_token_mask, grammar_output, req_ids, self.vocab_size, self.device)
        out = self.sampler(logits[:num_reqs], sampling_md, token_mask)
        sampled = out.sampled_token_ids.cpu().numpy()
        failed = self._take_failed_requests(req_ids, samples)
        sampled_token_ids = self._record_sampled(sampled, samples)

        logprobs = None
        if out.logprobs_tensors is not None and samples.any():
            # One row per sampled token, in request order: requests that sampled nothing have no row.
            rows = torch.from_numpy(np.flatnonzero(samples)).to(self.device)
            t = out.logprobs_tensors
            logprobs = LogprobsLists(
                t.logprob_token_ids[rows].tolist(), t.logprobs[rows].tolist(), t.selected_token_ranks[rows].tolist()
            )
        prompt_logprobs = compute_prompt_logprobs(prompt_plan or [], logits[num_reqs:], self.requests)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=self._req_id_to_index(),
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_logprobs,
            num_nans_in_logits=nans,
            failed_requests=failed,
            draft_token_ids=spec.propose(batch, req_ids, samples) if spec is not None else None,
        )

    def replace_model(self, model: torch.nn.Module) -> None:
        """Runs ``model`` (the same weights reloaded after a deep sleep) from now on, with the LoRA adapters that
        were loaded wrapped around it again."""
        self.model = model
        self.fused_decoder = self._build_fused_decoder(model)
        self.prompt_embeds = PromptEmbedsInputs(model)
        if self.lora is not None:
            loaded = [self.lora.get_adapter(i) for i in sorted(self.lora.list_adapters())]
            self.lora = LoRAModelManager(model, self.config.lora_config, self.device, self.dtype)  # type: ignore[arg-type]
            for adapter in loaded:
                if adapter is not None:
                    self.lora.add_adapter(LoRARequest(adapter.name, adapter.int_id, adapter.path))

    def _prepare_lora(self, lora: LoRAModelManager, num_scheduled: np.ndarray) -> None:
        """Tells the LoRA layers which adapter each token of the step runs with (reloading an adapter the host
        cache evicted since its request arrived)."""
        ids = np.zeros(len(num_scheduled), dtype=np.int64)
        for row, state in enumerate(self.input_batch.states[: len(num_scheduled)]):
            if state is not None and state.lora_request is not None:
                lora.add_adapter(state.lora_request)
                ids[row] = state.lora_request.lora_int_id
        lora.prepare_step(np.repeat(ids, num_scheduled))

    def _record_sampled(self, sampled: np.ndarray, samples: np.ndarray) -> list[list[int]]:
        """Appends each sampling row's token to its request's live output list and to the batch (rows that
        sample nothing get ``[]``); returns ``sampled_token_ids`` in row order."""
        batch = self.input_batch
        rows = np.flatnonzero(samples)
        if not rows.size:
            return [[] for _ in range(len(samples))]
        batch.append_tokens(rows, sampled[rows])
        states = batch.states
        if rows.size == len(samples):
            tokens = sampled.tolist()
            for state, token in zip(states, tokens, strict=False):
                assert state is not None
                state.output_token_ids.append(token)  # the live list the processors read
            return [[token] for token in tokens]
        result: list[list[int]] = [[] for _ in range(len(samples))]
        for row in rows.tolist():
            token = int(sampled[row])
            state = states[row]
            assert state is not None
            state.output_token_ids.append(token)
            result[row] = [token]
        return result

    def _req_id_to_index(self) -> dict[str, int]:
        """``req_id -> row`` of the condensed batch (one dict per batch composition; consumers only read it)."""
        batch = self.input_batch
        if self._index_version != batch.version:
            self._index_map = dict(batch.req_id_to_index)
            self._index_version = batch.version
        return self._index_map

    def _wants_prompt_logprobs(self, batch: InputBatch) -> bool:
        """Whether any row asks for prompt logprobs (cached per batch composition)."""
        if self._prompt_lp_version != batch.version:
            self._prompt_lp = any(
                state is not None and state.sampling_params.prompt_logprobs is not None for state in batch.states
            )
            self._prompt_lp_version = batch.version
        return self._prompt_lp

    def _take_failed_requests(self, req_ids: list[str], samples: np.ndarray) -> dict[str, str] | None:
        """The requests a logits processor failed on this step (``req_id -> message``); their rows are marked as
        sampling nothing, so no token of theirs is kept and the logprobs rows stay aligned."""
        take = getattr(self.logitsprocs, "take_failed_rows", None)
        failed_rows = take() if take is not None else None
        if not failed_rows:
            return None
        for row in failed_rows:
            samples[row] = False
        return {req_ids[row]: message for row, message in failed_rows.items() if row < len(req_ids)}

    # ------------------------------------------------------------------ state
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        cached = so.scheduled_cached_reqs
        for req_id in list(batch.req_id_to_index):
            if req_id in so.preempted_req_ids or req_id not in so.num_scheduled_tokens:
                batch.remove_request(req_id)

        to_add: list[CachedRequestState] = []
        for new in so.scheduled_new_reqs:
            batch.remove_request(new.req_id)
            previous = self.requests.get(new.req_id)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                generator=self._generator_for(new.sampling_params, previous, len(new.output_token_ids)),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                pooling_params=new.pooling_params,
                output_token_ids=list(new.output_token_ids),
                num_prompt_logprobs_done=(
                    previous.num_prompt_logprobs_done
                    if previous is not None and previous.prompt_token_ids == new.prompt_token_ids
                    else 0
                ),
                lora_request=new.lora_request,
                prompt_embeds=new.prompt_embeds,
            )
            self.requests[new.req_id] = state
            to_add.append(state)

        get_state, index_of = self.requests.get, batch.req_id_to_index
        all_token_ids, num_output_tokens, new_block_ids = (
            cached.all_token_ids,
            cached.num_output_tokens,
            cached.new_block_ids,
        )
        num_with_counts, num_with_blocks = len(num_output_tokens), len(new_block_ids)
        kept_rows: list[int] = []  # rows that keep their request: num_computed_tokens set at once below
        kept_computed: list[int] = []
        for i, req_id in enumerate(cached.req_ids):
            known = get_state(req_id)
            if known is None:
                raise BatchStateError(f"Scheduled cached request {req_id!r} is unknown to the executor.")
            state = known
            computed = cached.num_computed_tokens[i]
            state.num_computed_tokens = computed
            tokens_changed = False
            if all_token_ids and req_id in all_token_ids:
                outputs = all_token_ids[req_id][state.num_prompt_tokens :]
                if outputs != state.output_token_ids:
                    state.output_token_ids[:] = outputs  # in place: processors hold this list
                    tokens_changed = True
            if i < num_with_counts and num_output_tokens[i] < len(state.output_token_ids):
                del state.output_token_ids[num_output_tokens[i] :]
                tokens_changed = True
            new_blocks = new_block_ids[i] if i < num_with_blocks else None
            if new_blocks:
                state.block_ids.extend(new_blocks)
            row = index_of.get(req_id)
            if row is not None and tokens_changed:
                batch.remove_request(req_id)
                row = None
            if row is None:
                to_add.append(state)
                continue
            kept_rows.append(row)
            kept_computed.append(computed)
            if new_blocks:
                batch.append_block_ids(row, new_blocks)
        if kept_rows:
            batch.num_computed_tokens[kept_rows] = kept_computed

        for state in to_add:
            batch.add_request(state)
        batch.condense()
        self.logitsprocs.update_state(batch.get_batch_update())

    def _generator_for(
        self, params: Any, previous: CachedRequestState | None, num_output_tokens: int
    ) -> torch.Generator | None:
        """The request's own generator. A fresh request gets a newly seeded one; a resumed request (re-sent
        with its output tokens) keeps the one it had, or, if this executor never saw it, a newly seeded one
        fast-forwarded past the ``num_output_tokens`` draws already made: either way it continues the same
        random stream."""
        if params.sampling_type != SamplingType.RANDOM_SEED:
            return None
        resumed = previous is not None and len(previous.output_token_ids) == num_output_tokens > 0
        if resumed and previous is not None and previous.generator is not None:
            return previous.generator
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed)
        scratch = torch.empty(self.vocab_size, device=self.device)
        for _ in range(num_output_tokens):
            draw_uniform_(scratch, generator)
        return generator

    # ------------------------------------------------------------------ inputs
    def _prepare_inputs(
        self, num_scheduled: np.ndarray, num_drafts: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return prepare_inputs(
            self.input_batch,
            num_scheduled,
            self.block_size,
            self.buffers,
            self.device,
            stable_metadata=self.kv_connector is not None,
            num_drafts=num_drafts,
            num_groups=self.layout.num_groups,
        )

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        logits_indices: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        *,
        check_arguments: bool = False,
    ) -> torch.Tensor:
        """The logits rows ``logits_indices`` of one packed step; ``inputs_embeds`` (prompt_embeds.py) replaces
        ``input_ids`` when the step computes prompt-embeds positions; ``check_arguments``: the attention checks what
        each layer passes it (the start-up probe)."""
        fused = self.fused_decoder
        if (
            fused is not None
            and inputs_embeds is None
            and self.kv_connector is None
            and logits_indices.numel() == md.num_tokens
        ):
            assert self._kv_buffer is not None
            logits = fused(input_ids, positions, md, self._kv_buffer)
            if logits is not None:
                return logits
        kwargs: dict[str, Any] = {"input_ids": input_ids, "position_ids": positions, "use_cache": False}
        if inputs_embeds is not None:
            kwargs["inputs_embeds"] = inputs_embeds
            del kwargs["input_ids"]
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = logits_indices
        caches = self.kv_caches, self.kv_connector, self.kv_layers, self.kv_scales
        groups = self.layout.layer_group if md.groups else ()
        with forward_context(md, *caches, check_arguments=check_arguments, layer_groups=groups) as ctx:
            output = self.model(**kwargs)
        if ctx.num_calls != self.spec.num_layers:
            raise AttentionRoutingError(
                f"{type(self.model).__name__} called vllite's attention {ctx.num_calls} times for "
                f"{self.spec.num_layers} layers; this architecture does not route attention through "
                "transformers' attention interface, so vllite cannot run it."
            )
        if self.routed_experts is not None:
            n = int(md.seq_lens.shape[0])
            batch = self.input_batch
            self.routed_experts.end_forward(
                md.slot_mapping, batch.req_ids[:n], batch.num_computed_tokens[:n], md.query_start_loc.tolist()
            )
        logits = output.logits[0]
        if not self._accepts_logits_to_keep:
            logits = logits[logits_indices]
        return logits.float()  # a bfloat16 model's logits: logprobs, penalties and sampling are float32

    def _sampling_metadata(self, samples: np.ndarray) -> SamplingMetadata:
        """The step's sampling metadata (``samples[row]``: the row keeps its token), reused while it can be."""
        return self.sampling_inputs.get(samples)

    def _add_penalties(self, md: SamplingMetadata, n: int) -> None:
        """Sets ``md``'s penalty tensors from the batch's current tokens (rows ``0 .. n-1``) when a row has one."""
        self.sampling_inputs.add_penalties(md, n)

    # ------------------------------------------------------------------ memory profiling (CUDA)
    def _profile_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, logits_indices: torch.Tensor
    ) -> None:
        """``profile_run``'s dummy forward: the model, then a sort of the logits rows kept (top-p/top-k's peak)."""
        self._forward(input_ids, positions, md, logits_indices).sort(dim=-1)

    def profile_run(self, num_tokens: int) -> None:
        """One forward over ``num_tokens`` dummy tokens (plus a sort of as many logits rows as requests) so the
        caller can measure peak activation memory; uses a temporary KV cache just large enough."""
        num_tokens = max(1, min(num_tokens, self.max_model_len))
        self._dummy_forward(num_tokens, min(num_tokens, self.max_num_reqs), sort=True)

    def probe_forward(self) -> None:
        """A few dummy tokens through the model's own forward (never the fused decode step), so that what the
        architecture passes to the attention is checked at start-up, before any request runs."""
        self._dummy_forward(max(1, min(4, self.max_model_len)), 1, sort=False)

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int, num_rows: int, *, sort: bool) -> None:
        """A forward over ``num_tokens`` zeros keeping the last ``num_rows`` logits rows, on a temporary KV cache
        just large enough; the KV cache, connector and LoRA step in use are left as they were."""
        blocks = -(-num_tokens // self.block_size)
        saved = self._kv_buffer, self._v_buffer, self.kv_caches, self.kv_layers, self.kv_connector
        self.kv_connector = None  # dummy tokens: nothing to load or save
        if self.lora is not None:
            self.lora.clear_step()  # dummy tokens run on the base model
        try:
            self.allocate_kv_cache(blocks)
            dev = self.device
            md = AttentionMetadata(
                slot_mapping=torch.arange(num_tokens, device=dev),
                block_tables=torch.arange(blocks, dtype=torch.int32, device=dev).unsqueeze(0),
                seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
                query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
                max_query_len=num_tokens,
                max_seq_len=num_tokens,
            )
            ids = torch.zeros(1, num_tokens, dtype=torch.int64, device=dev)
            pos = torch.arange(num_tokens, device=dev).unsqueeze(0)
            keep = torch.arange(num_tokens - num_rows, num_tokens, device=dev)
            if sort:
                self._profile_forward(ids, pos, md, keep)
            else:
                self._forward(ids, pos, md, keep, check_arguments=True)
        finally:
            self._kv_buffer, self._v_buffer, self.kv_caches, self.kv_layers, self.kv_connector = saved
