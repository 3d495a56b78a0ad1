"""Min tokens: forbid stop tokens until a request has generated ``min_tokens`` tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllite.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates
from vllite.sampling_params import SamplingParams

from .tensors import device_tensor

# (min_tokens, live output token list, stop token ids)
MinTokensState = tuple[int, Sequence[int], set[int]]


class MinTokensLogitsProcessor(LogitsProcessor):
    """Sets the stop tokens' logits (``SamplingParams.all_stop_token_ids``: EOS and ``stop_token_ids``)
    to -inf while a request has fewer than ``min_tokens`` output tokens.

    Not argmax-invariant. State is sparse and keeps each request's *live* output list, so the constraint
    lifts on the first ``update_state`` (``None`` updates included) after enough tokens exist; the device
    index tensors are rebuilt only when the set of constrained requests changes. Under speculative decoding,
    :meth:`apply_with_spec_decode` masks the stop tokens on exactly those draft rows that would still come
    before the ``min_tokens``-th token.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.pin_memory = is_pin_memory
        self.min_toks: dict[int, MinTokensState] = {}
        self.logits_slice = (self._device_tensor([], torch.int32), self._device_tensor([], torch.int32))
        self.neg_inf_tensor = torch.tensor(-float("inf"), dtype=torch.float32, device=self.device)

    def _device_tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return device_tensor(data, dtype, self.device, self.pin_memory)

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def add_request(
        params: SamplingParams, _prompt_tok_ids: list[int] | None, output_tok_ids: list[int]
    ) -> MinTokensState | None:
        """The state of a new request, or ``None`` if it has no unmet ``min_tokens``."""
        min_tokens = params.min_tokens
        if not min_tokens or len(output_tok_ids) >= min_tokens:
            return None
        return min_tokens, output_tok_ids, set(params.all_stop_token_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        needs_update = process_dict_updates(self.min_toks, batch_update, self.add_request)
        if self.min_toks:
            done = [index for index, (min_tok, out, _) in self.min_toks.items() if len(out) >= min_tok]
            if done:
                needs_update = True
                for index in done:
                    del self.min_toks[index]
        if needs_update:
            reqs: list[int] = []
            tok_ids: list[int] = []
            for req, (_, _, stop_tok_ids) in self.min_toks.items():
                reqs.extend([req] * len(stop_tok_ids))
                tok_ids.extend(stop_tok_ids)
            self.logits_slice = (
                self._device_tensor(reqs, torch.int32),
                self._device_tensor(tok_ids, torch.int32),
            )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_toks:
            logits.index_put_(self.logits_slice, self.neg_inf_tensor)
        return logits

    def apply_with_spec_decode(self, logits: torch.Tensor, num_draft_tokens: list[int]) -> torch.Tensor:
        """Masks stop tokens on flattened draft rows: request ``i`` owns ``num_draft_tokens[i]`` consecutive
        rows, and its draft row ``k`` is masked iff ``k < min_tokens - len(output)``."""
        if not self.min_toks:
            return logits
        num_draft = np.asarray(num_draft_tokens, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(num_draft)])
        rows: list[np.ndarray] = []
        toks: list[np.ndarray] = []
        for req_idx, (min_tok, out, stop_tok_ids) in self.min_toks.items():
            if not stop_tok_ids or req_idx >= len(num_draft):
                continue
            n_mask = int(min(max(min_tok - len(out), 0), num_draft[req_idx]))
            if n_mask <= 0:
                continue
            stops = np.fromiter(sorted(stop_tok_ids), dtype=np.int64)
            row_ids = np.arange(starts[req_idx], starts[req_idx] + n_mask, dtype=np.int64)
            rows.append(np.repeat(row_ids, len(stops)))
            toks.append(np.tile(stops, n_mask))
        if rows:
            index = (
                torch.from_numpy(np.concatenate(rows)).to(self.device, non_blocking=True),
                torch.from_numpy(np.concatenate(toks)).to(self.device, non_blocking=True),
            )
            logits.index_put_(index, self.neg_inf_tensor)
        return logits
