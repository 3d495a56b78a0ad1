"""A step's ``SamplingMetadata``, built from the persistent batch's arrays and reused between steps.

The metadata depends on the batch's composition (which request sits in which row, with which parameters) and,
for penalties, on its tokens. While the composition is unchanged (``InputBatch.version``) and every row samples,
the last step's metadata is handed out again with only the penalty token tensors rebuilt (when a row has one).
A step with a row that samples nothing (a partial prefill) gets fresh metadata: that row's generator must not
advance.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllite.plugins.transformers_executor.input_batch import InputBatch
from vllite.plugins.transformers_executor.sampler import SamplingMetadata


class SamplingInputs:
    """Builds (and reuses) the sampling metadata of one model runner's persistent batch."""

    def __init__(
        self,
        batch: InputBatch,
        vocab_size: int,
        device: torch.device,
        default_generator: torch.Generator,
        logitsprocs: Any,
    ) -> None:
        self.batch = batch
        self.vocab_size = vocab_size
        self.device = device
        self.default_generator = default_generator
        self.logitsprocs = logitsprocs
        self._md_cache: SamplingMetadata | None = None
        self._md_version = -1

    def get(self, samples: np.ndarray) -> SamplingMetadata:
        """The step's sampling metadata; reused from the last step while the batch composition is unchanged and
        every row samples (only the penalties' token counts are rebuilt)."""
        batch = self.batch
        n = batch.num_reqs
        all_sample = bool(samples.all())
        md = self._md_cache
        if md is not None and all_sample and self._md_version == batch.version:
            self.add_penalties(md, n)
            return md
        md = self.build(samples)
        self._md_cache, self._md_version = (md, batch.version) if all_sample else (None, -1)
        return md

    def build(self, samples: np.ndarray) -> SamplingMetadata:
        """Fresh metadata for the batch's rows (``samples[row]``: the row keeps its token this step)."""
        batch = self.batch
        n = batch.num_reqs
        dev = self.device
        greedy = batch.temperature[:n] < 1e-5
        all_greedy, all_random = bool(greedy.all()), bool((~greedy).all())
        top_p = top_k = None
        if not all_greedy and (batch.top_p[:n] < 1.0).any():
            top_p = torch.from_numpy(batch.top_p[:n].copy()).to(dev)
        k = batch.top_k[:n]
        if not all_greedy and ((k > 0) & (k < self.vocab_size)).any():
            top_k = torch.from_numpy(np.where(k > 0, k, self.vocab_size)).to(dev)
        generators: dict[int, torch.Generator] = {}
        max_logprobs: int | None = None
        fixed_logprob_ids: dict[int, list[int]] = {}
        allowed_rows: list[int] = []
        for row in range(n):
            state = batch.state_at(row)
            params = state.sampling_params
            # A row whose token is discarded (partial prefill) must not advance its request's generator.
            if state.generator is not None and samples[row]:
                generators[row] = state.generator
            if params.logprobs is not None:
                wanted = self.vocab_size if params.logprobs == -1 else params.logprobs
                max_logprobs = max(max_logprobs or 0, wanted)
                if params.logprob_token_ids:
                    fixed_logprob_ids[row] = params.logprob_token_ids
            if params.allowed_token_ids:
                allowed_rows.append(row)
        md = SamplingMetadata(
            temperature=torch.from_numpy(batch.temperature[:n].copy()).to(dev),
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=top_p,
            top_k=top_k,
            generators=generators,
            default_generator=self.default_generator,
            max_num_logprobs=max_logprobs,
            logprob_token_ids=fixed_logprob_ids,
            logitsprocs=self.logitsprocs,
        )
        if allowed_rows:
            mask = torch.zeros(n, self.vocab_size, dtype=torch.bool)
            for row in allowed_rows:
                ids = [t for t in batch.state_at(row).sampling_params.allowed_token_ids or () if t < self.vocab_size]
                mask[row] = True
                mask[row, ids] = False
            md.allowed_token_ids_mask = mask.to(dev)
        self.add_penalties(md, n)
        return md

    def add_penalties(self, md: SamplingMetadata, n: int) -> None:
        """Sets the penalty tensors (token counts from the batch's current tokens) when a row has a penalty."""
        batch = self.batch
        freq, pres, rep = batch.frequency_penalties[:n], batch.presence_penalties[:n], batch.repetition_penalties[:n]
        if not ((freq != 0).any() or (pres != 0).any() or (rep != 1).any()):
            return
        dev = self.device
        width = int(batch.num_tokens[:n].max())
        tokens = batch.token_ids[:n, :width]
        pos = np.arange(width)[None, :]
        n_prompt = batch.num_prompt_tokens[:n, None]
        pad = self.vocab_size
        in_prompt = (pos < n_prompt) & ~batch.prompt_is_embeds[:n, None]  # an embeds prompt has no token ids
        md.prompt_token_ids = torch.from_numpy(np.where(in_prompt, tokens, pad)).to(dev)
        is_output = (pos >= n_prompt) & (pos < batch.num_tokens[:n, None])
        md.output_token_ids = torch.from_numpy(np.where(is_output, tokens, pad)).to(dev)
        md.frequency_penalties = torch.from_numpy(freq.copy()).to(dev)
        md.presence_penalties = torch.from_numpy(pres.copy()).to(dev)
        md.repetition_penalties = torch.from_numpy(rep.copy()).to(dev)
