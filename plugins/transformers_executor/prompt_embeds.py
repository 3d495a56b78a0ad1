"""``prompt_embeds`` inputs: a step's ``inputs_embeds`` when it computes prompt positions of embeds requests.

A request whose prompt came as embedding rows (``{"prompt_embeds": tensor}``, ``--enable-prompt-embeds``) has
placeholder token ids (zeros) for its prompt in the batch. A step in which some row computes such prompt positions
(a prefill chunk, the last prompt token recomputed after a full prefix-cache hit, a recompute after preemption)
feeds the model ``inputs_embeds`` instead of ``input_ids``: the whole packed batch is embedded with the model's own
input embedding (token-id requests and the sampled tokens of embeds requests, exactly as the model would embed them),
then the rows of those prompt positions are overwritten with the request's embeddings. A step with no such position
(every pure decode step included, so the compiled CPU decode step keeps serving it) takes ``input_ids`` as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllite.plugins.transformers_executor.input_batch import InputBatch

__all__ = ["PromptEmbedsInputs"]


class PromptEmbedsInputs:
    """Builds a step's ``inputs_embeds`` (``[1, num_tokens, hidden_size]``) for the model runner, or ``None`` when
    the step computes no prompt-embeds position. The rows holding embeds requests are found once per batch
    composition (``InputBatch.version``), so steps without embeds requests cost one comparison."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._version = -1
        self._rows = np.empty(0, dtype=np.int64)

    def _embeds_rows(self, batch: InputBatch) -> np.ndarray:
        if self._version != batch.version:
            states = batch.states[: batch.num_reqs]
            found = [row for row, s in enumerate(states) if s is not None and s.prompt_embeds is not None]
            self._rows = np.asarray(found, dtype=np.int64)
            self._version = batch.version
        return self._rows

    def build(self, batch: InputBatch, num_scheduled: np.ndarray, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's ``inputs_embeds`` for the packed ``input_ids`` (``[1, num_tokens]``) of rows
        ``0 .. len(num_scheduled)-1`` computing ``num_scheduled[i]`` tokens each; ``None`` if no row computes a
        prompt position of an embeds prompt."""
        rows = self._embeds_rows(batch)
        if not rows.size:
            return None
        computed = batch.num_computed_tokens[rows]
        in_prompt = computed < batch.num_prompt_tokens[rows]
        if not in_prompt.any():
            return None
        starts = np.cumsum(num_scheduled) - num_scheduled  # each row's first packed token
        get_input_embeddings: Any = self.model.get_input_embeddings
        embeds = get_input_embeddings()(input_ids)
        for row in rows[in_prompt].tolist():
            state = batch.state_at(row)
            first = int(batch.num_computed_tokens[row])
            last = min(first + int(num_scheduled[row]), state.num_prompt_tokens)
            offset = int(starts[row])
            assert state.prompt_embeds is not None
            rows_in = state.prompt_embeds[first:last]
            embeds[0, offset : offset + last - first] = rows_in.to(device=embeds.device, dtype=embeds.dtype)
        return embeds
