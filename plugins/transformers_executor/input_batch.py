"""The persistent input batch: one row per running request, kept across steps.

A request keeps its row while it runs. Each step the model runner removes finished and unscheduled requests,
adds new or resumed ones into the freed rows (smallest first), then *condenses*: the last rows move into the
remaining holes so rows ``0 .. num_reqs-1`` are all occupied. Every change is recorded in a
``BatchUpdateBuilder`` so the logits processors can follow their requests (vLLM V1 semantics).

Per row the batch keeps the token ids (prompt + output), ``num_computed_tokens``, the block table and the
sampling parameters as arrays, so the model runner and the sampler build their tensors by slicing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllite.exceptions import BatchStateError
from vllite.logits_processor.builder import BatchUpdateBuilder
from vllite.logits_processor.interface import BatchUpdate, MoveDirectionality
from vllite.sampling_params import SamplingType

if TYPE_CHECKING:
    from vllite.lora import LoRARequest
    from vllite.pooling_params import PoolingParams
    from vllite.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the executor remembers about one request between steps (also while it is preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    # The live output list: the batch hands this very object to the logits processors.
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt positions whose prompt logprobs were already returned (they are not returned twice).
    num_prompt_logprobs_done: int = 0
    lora_request: LoRARequest | None = None  # the adapter its tokens run with (None: the base model)
    pooling_params: PoolingParams | None = None  # a request to a pooling model
    # An embeds prompt's rows [num_prompt_tokens, hidden_size]; prompt_token_ids are placeholders (prompt_embeds.py).
    prompt_embeds: torch.Tensor | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


# Per-row numpy arrays that move with their request when the batch condenses.
_ROW_ARRAYS = (
    "token_ids",
    "num_tokens",
    "num_prompt_tokens",
    "num_computed_tokens",
    "block_table",
    "num_blocks",
    "temperature",
    "top_p",
    "top_k",
    "frequency_penalties",
    "presence_penalties",
    "repetition_penalties",
    "prompt_is_embeds",
)


class InputBatch:
    """Rows of running requests, with their tokens, blocks and sampling parameters."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, vocab_size: int):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.req_ids_by_row: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.states: list[CachedRequestState | None] = []

        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)  # 0 = disabled
        self.frequency_penalties = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalties = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalties = np.ones(max_num_reqs, dtype=np.float32)
        # Rows whose prompt came as embeddings: their placeholder prompt ids count for no penalty.
        self.prompt_is_embeds = np.zeros(max_num_reqs, dtype=bool)

        self.batch_update_builder = BatchUpdateBuilder()
        # Bumped whenever a row's request or sampling parameters change (add, remove, move): what the model
        # runner derives from the batch's composition (request ids, sampling metadata) is reused while it holds.
        self.version = 0
        self._req_ids: list[str] = []
        self._req_ids_version = -1

    # ------------------------------------------------------------------ views
    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request ids of rows ``0 .. num_reqs-1`` (valid after :meth:`condense`); the same list object while the
        composition is unchanged, so do not modify it."""
        if self._req_ids_version != self.version:
            self._req_ids = [r for r in self.req_ids_by_row[: self.num_reqs] if r is not None]
            self._req_ids_version = self.version
        return self._req_ids

    def state_at(self, row: int) -> CachedRequestState:
        state = self.states[row]
        assert state is not None, f"row {row} is empty"
        return state

    # ------------------------------------------------------------------ membership
    def add_request(self, state: CachedRequestState) -> int:
        """Puts ``state`` into the lowest freed row (or appends a row) and records it as added."""
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        num_tokens = state.num_tokens
        if num_tokens > self.max_model_len:
            raise ValueError(f"request {state.req_id!r} has {num_tokens} tokens > max_model_len={self.max_model_len}")
        row = self.batch_update_builder.pop_removed()
        if row is None:
            row = self.num_reqs
        if row >= self.max_num_reqs:
            raise BatchStateError(f"the input batch is full ({self.max_num_reqs} requests; raise max_num_seqs)")
        self.version += 1
        if row == len(self.req_ids_by_row):
            self.req_ids_by_row.append(state.req_id)
            self.states.append(state)
        else:
            self.req_ids_by_row[row] = state.req_id
            self.states[row] = state
        self.req_id_to_index[state.req_id] = row

        n_prompt = state.num_prompt_tokens
        self.token_ids[row, :n_prompt] = state.prompt_token_ids
        self.token_ids[row, n_prompt:num_tokens] = state.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.set_block_ids(row, state.block_ids)
        self.prompt_is_embeds[row] = state.prompt_embeds is not None

        params = state.sampling_params
        greedy = params.sampling_type == SamplingType.GREEDY
        self.temperature[row] = 0.0 if greedy else params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k if params.top_k > 0 else 0
        self.frequency_penalties[row] = params.frequency_penalty
        self.presence_penalties[row] = params.presence_penalty
        self.repetition_penalties[row] = params.repetition_penalty
        self.batch_update_builder.added.append((row, params, state.prompt_token_ids, state.output_token_ids))
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Frees the row of ``req_id`` (``None`` if it is not in the batch) and records it as removed."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.version += 1
        self.batch_update_builder.removed_append(row)
        self.req_ids_by_row[row] = None
        self.states[row] = None
        return row

    def condense(self) -> None:
        """Moves the last rows into the holes left by removals, so rows ``0 .. num_reqs-1`` are occupied."""
        builder = self.batch_update_builder
        num_reqs = self.num_reqs
        if not builder.has_removed():
            return
        if num_reqs == 0:
            self.req_ids_by_row.clear()
            self.states.clear()
            return
        last = len(self.req_ids_by_row) - 1
        while (hole := builder.peek_removed()) is not None:
            while last >= 0 and self.req_ids_by_row[last] is None:
                last -= 1
            if hole >= last:
                break
            builder.pop_removed()
            self._move_row(last, hole)
            builder.moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            last -= 1
        del self.req_ids_by_row[num_reqs:]
        del self.states[num_reqs:]

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids_by_row[src]
        assert req_id is not None
        self.version += 1
        self.req_ids_by_row[dst], self.req_ids_by_row[src] = req_id, None
        self.states[dst], self.states[src] = self.states[src], None
        self.req_id_to_index[req_id] = dst
        for name in _ROW_ARRAYS:
            array = getattr(self, name)
            if array.ndim == 2:
                n = int(self.num_tokens[src]) if name == "token_ids" else int(self.num_blocks[src])
                array[dst, :n] = array[src, :n]
            else:
                array[dst] = array[src]

    def get_batch_update(self) -> BatchUpdate | None:
        """The step's ``BatchUpdate`` for the logits processors (``None`` when membership did not change)."""
        return self.batch_update_builder.get_and_reset(self.num_reqs)

    # ------------------------------------------------------------------ per-row updates
    def set_block_ids(self, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        if n > self.block_table.shape[1]:
            raise ValueError(f"{n} blocks exceed the per-request maximum of {self.block_table.shape[1]}")
        self.block_table[row, :n] = block_ids
        self.num_blocks[row] = n

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise ValueError(f"{end} blocks exceed the per-request maximum of {self.block_table.shape[1]}")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Records one sampled token for each of ``rows`` at once (vectorised :meth:`append_token`)."""
        n = self.num_tokens[rows]
        fits = n < self.max_model_len
        if fits.all():
            self.token_ids[rows, n] = token_ids
        else:
            self.token_ids[rows[fits], n[fits]] = token_ids[fits]
        self.num_tokens[rows] = n + 1

    def append_token(self, row: int, token_id: int) -> None:
        """Records a sampled token in the row (the caller appends it to the live output list too)."""
        n = int(self.num_tokens[row])
        if n < self.max_model_len:
            self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
