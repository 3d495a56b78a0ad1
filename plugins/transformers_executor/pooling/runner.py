"""The model runner of a pooling model: the generating runner's batch, inputs and attention, then the pooler
instead of the sampler.

Each step runs the scheduled tokens through the model's base (hidden states, no logits) and hands every request's
rows to the :class:`~.pooler.Pooler`; a request whose prompt completes gets its pooled tensor in
``ModelRunnerOutput.pooler_output`` (the scheduler finishes it with that) and never samples. A BERT-style model
also gets its ``token_type_ids``: 0, and 1 from a cross-encoder pair's second text (``extra_kwargs``'
``token_type_start``).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from vllite.config import EngineConfig
from vllite.exceptions import AttentionRoutingError
from vllite.plugins.transformers_executor.attention import AttentionMetadata, forward_context
from vllite.plugins.transformers_executor.model_loader import ModelSpec
from vllite.plugins.transformers_executor.model_runner import ModelRunner
from vllite.plugins.transformers_executor.pooling.loader import LoadedPoolingModel
from vllite.plugins.transformers_executor.pooling.pooler import ClassificationHead, Pooler, PoolingRow
from vllite.sched.output import ModelRunnerOutput, SchedulerOutput


class PoolingModelRunner(ModelRunner):
    """A :class:`ModelRunner` whose steps pool instead of sampling (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedPoolingModel,
        spec: ModelSpec,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(config, loaded.model, spec, device, dtype)
        self.base = loaded.base
        text_config: Any = getattr(loaded.model.config, "text_config", None) or loaded.model.config
        matryoshka = getattr(text_config, "matryoshka_dimensions", None)
        if matryoshka is None and getattr(text_config, "is_matryoshka", False):
            matryoshka = range(1, text_config.hidden_size + 1)
        head = ClassificationHead(loaded.model) if loaded.setup.kind == "classify" else None
        self.pooler = Pooler(
            loaded.setup,
            loaded.pooling_type,
            head,
            int(text_config.hidden_size),
            tuple(matryoshka) if matryoshka is not None else None,
        )
        self._takes_token_types = "token_type_ids" in inspect.signature(self.base.forward).parameters

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.pooler.forget(req_id)
        self._update_states(scheduler_output)
        batch = self.input_batch
        if scheduler_output.total_num_scheduled_tokens == 0 or batch.num_reqs == 0:
            return ModelRunnerOutput.empty()
        req_ids = list(batch.req_ids)
        scheduled = scheduler_output.num_scheduled_tokens
        num_scheduled = np.fromiter(map(scheduled.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
        computed = batch.num_computed_tokens[: len(req_ids)].tolist()
        input_ids, positions, metadata = self._prepare_inputs(num_scheduled)
        starts = metadata.query_start_loc.tolist()
        rows = [
            self._row(req_id, starts[i], int(num_scheduled[i]), int(computed[i])) for i, req_id in enumerate(req_ids)
        ]
        token_types = self._token_type_ids(rows, positions) if self._takes_token_types else None
        hidden = self._hidden_states(input_ids, positions, metadata, token_types)
        pooled, failed = self.pooler.step(hidden, rows)
        for req_id in failed:
            self.pooler.forget(req_id)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=[[] for _ in req_ids],
            pooler_output=pooled,
            failed_requests=failed or None,
        )

    def _hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, token_types: torch.Tensor | None
    ) -> torch.Tensor:
        """The base model's last hidden states of the packed batch, ``[num_tokens, hidden]``."""
        kwargs: dict[str, Any] = {"input_ids": input_ids, "position_ids": positions}
        if token_types is not None:
            kwargs["token_type_ids"] = token_types
        with forward_context(md, self.kv_caches) as ctx:
            output = self.base(**kwargs)
        if ctx.num_calls != self.spec.num_layers:
            raise AttentionRoutingError(
                f"{type(self.base).__name__} called vllite's attention {ctx.num_calls} times for "
                f"{self.spec.num_layers} layers; vllite cannot run this architecture."
            )
        return output[0][0]

    def _profile_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, logits_indices: torch.Tensor
    ) -> None:
        """A pooling model's dummy forward: its base and the pooler's head over the rows a step could pool (it has
        no logits to sort)."""
        token_types = torch.zeros_like(positions) if self._takes_token_types else None
        hidden = self._hidden_states(input_ids, positions, md, token_types)
        if self.pooler.head is not None:
            self.pooler.head(hidden[logits_indices])

    def _row(self, req_id: str, start: int, length: int, num_computed: int) -> PoolingRow:
        state = self.requests[req_id]
        if state.pooling_params is None:
            raise ValueError(f"request {req_id!r} has no pooling_params; a pooling model runs pooling requests only.")
        return PoolingRow(req_id, start, length, num_computed, state.prompt_token_ids, state.pooling_params)

    def _token_type_ids(self, rows: list[PoolingRow], positions: torch.Tensor) -> torch.Tensor:
        """0 for every token, 1 from each pair's second text on."""
        token_types = torch.zeros_like(positions)
        for row in rows:
            extra = row.params.extra_kwargs or {}
            second = extra.get("token_type_start")
            if second is not None:
                token_types[0, row.start : row.start + row.length] = (
                    positions[0, row.start : row.start + row.length] >= second
                ).long()
        return token_types
