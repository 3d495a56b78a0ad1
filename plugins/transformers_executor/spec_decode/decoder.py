"""One step of n-gram speculative decoding inside the model runner: draft in, verify, draft out.

1. ``write_drafts``: the drafts the scheduler scheduled (``scheduled_spec_decode_tokens``) are written into the
   persistent batch after each request's known tokens, so the packed input holds ``1 + D`` query tokens for a
   request with ``D`` drafts (the attention already handles multi-token queries per sequence); one forward
   pass computes them all.
2. ``logits_indices``: the logits of a request's last ``1 + D`` scheduled positions are kept: position ``j``
   predicts the token after draft ``j - 1``.
3. ``sample``: drafts are verified position by position. At position ``j`` every request still verifying gets
   its logits row ``j`` with the logits processors and penalties applied *with the token history up to that
   position*: the accepted drafts are appended to the request's live output list (and the batch) before the
   next position, and processors are told with ``update_state(None)``, exactly as after a normal step. So every
   processor (min-tokens, logit bias, the thinking budget, custom, slot-interface) and every penalty sees what
   it would see without drafts, and the :class:`RejectionSampler` keeps the target distribution.
   A request stops at its first rejected draft (which is replaced by the sampled token) or, with all drafts
   accepted, after the bonus token: ``G = accepted + 1`` tokens, which is what the scheduler's rollback
   (``D - (G - 1)`` rejected) expects.
4. ``propose``: the :class:`NgramProposer` drafts the next step's tokens from each sampled request's history,
   capped so a request never drafts past ``max_model_len`` or its ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllite.plugins.transformers_executor.sampler import SamplingMetadata, apply_penalties, gather_logprobs
from vllite.plugins.transformers_executor.spec_decode.ngram import NgramProposer
from vllite.plugins.transformers_executor.spec_decode.rejection_sampler import NO_DRAFT, RejectionSampler
from vllite.protocol import LogprobsLists

if TYPE_CHECKING:
    from vllite.plugins.transformers_executor.input_batch import CachedRequestState, InputBatch
    from vllite.speculative_config import SpeculativeConfig

#: Builds the step's sampling metadata for the rows marked True (their generators are included).
MetadataBuilder = Callable[[np.ndarray], SamplingMetadata]


@dataclass
class DraftSample:
    """The tokens each request emitted in a verification step, and their logprobs rows when asked."""

    sampled_token_ids: list[list[int]]  # per batch row; [] for rows that sampled nothing
    # Per batch row, one (top ids, top logprobs, rank) entry per emitted token; None without logprobs.
    logprob_rows: list[list[tuple[list[int], list[float], int]]] | None

    def logprobs(self, samples: np.ndarray) -> LogprobsLists | None:
        """Logprobs rows of the emitted tokens, request by request, for the rows still marked in ``samples``
        (a row failed by a logits processor is unmarked and has none)."""
        if self.logprob_rows is None:
            return None
        ids: list[list[int]] = []
        values: list[list[float]] = []
        ranks: list[int] = []
        for row, entries in enumerate(self.logprob_rows):
            if not samples[row]:
                continue
            for token_ids, logprobs, rank in entries:
                ids.append(token_ids)
                values.append(logprobs)
                ranks.append(rank)
        return LogprobsLists(ids, values, ranks) if ids else None


class NgramSpecDecoder:
    """The executor side of n-gram speculative decoding (see the module docstring)."""

    def __init__(self, spec_config: SpeculativeConfig, max_model_len: int) -> None:
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(
            spec_config.num_speculative_tokens, spec_config.prompt_lookup_min, spec_config.prompt_lookup_max
        )
        self.rejection_sampler = RejectionSampler()

    # ------------------------------------------------------------------ inputs
    @staticmethod
    def write_drafts(batch: InputBatch, scheduled: dict[str, list[int]], req_ids: Sequence[str]) -> np.ndarray:
        """Writes each scheduled request's drafts into its row after its known tokens (``num_tokens`` is not
        moved: drafts are not known tokens) and returns the number of drafts per row (``[num_reqs]``)."""
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        if not scheduled:
            return num_drafts
        for row, req_id in enumerate(req_ids):
            drafts = scheduled.get(req_id)
            if drafts:
                start = int(batch.num_tokens[row])
                batch.token_ids[row, start : start + len(drafts)] = drafts
                num_drafts[row] = len(drafts)
        return num_drafts

    @staticmethod
    def logits_indices(query_start_loc: np.ndarray, num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The packed-token indices whose logits are kept (each request's last ``1 + D`` positions, in order),
        and the index of each request's first kept row among them."""
        ends = query_start_loc[1:].astype(np.int64)
        counts = num_drafts + 1
        first_rows = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        offsets = np.arange(int(counts.sum())) - np.repeat(first_rows, counts)
        indices = np.repeat(ends - counts, counts) + offsets
        return indices, first_rows

    # ------------------------------------------------------------------ verification
    def sample(
        self,
        logits: torch.Tensor,
        first_rows: np.ndarray,
        num_drafts: np.ndarray,
        batch: InputBatch,
        samples: np.ndarray,
        build_metadata: MetadataBuilder,
        logitsprocs: Any,
    ) -> DraftSample:
        """Verifies every request's drafts (see the module docstring). ``logits`` holds the kept rows
        (``logits_indices``); ``samples[r]`` says whether row ``r`` samples at all this step. Emitted tokens
        are appended to the requests' live output lists and to the batch as they are decided."""
        num_reqs = len(num_drafts)
        active = samples[:num_reqs].copy()
        outputs: list[list[int]] = [[] for _ in range(num_reqs)]
        logprob_rows: list[list[tuple[list[int], list[float], int]]] = [[] for _ in range(num_reqs)]
        draft_matrix = np.full((num_reqs, int(num_drafts.max(initial=0)) + 1), NO_DRAFT, dtype=np.int64)
        for row in np.flatnonzero(num_drafts):
            start = int(batch.num_tokens[row])
            draft_matrix[row, : num_drafts[row]] = batch.token_ids[row, start : start + num_drafts[row]]
        device = logits.device
        wants_logprobs = False
        for position in range(draft_matrix.shape[1]):
            rows = np.flatnonzero(active)
            if rows.size == 0:
                break
            if position > 0:
                logitsprocs.update_state(None)  # the accepted drafts are now in the live output lists
            md = build_metadata(active)
            wants_logprobs = md.max_num_logprobs is not None
            index = torch.from_numpy(first_rows + np.minimum(position, num_drafts)).to(device)
            result, logprobs = self._verify_position(logits[index], md, torch.from_numpy(draft_matrix[:, position]))
            tokens = result.token_ids.tolist()
            accepted = result.accepted.tolist()
            for row in rows.tolist():
                token = tokens[row]
                outputs[row].append(token)
                state: CachedRequestState = batch.state_at(row)
                state.output_token_ids.append(token)  # the live list the processors read
                batch.append_token(row, token)
                if logprobs is not None:
                    logprob_rows[row].append(
                        (logprobs.logprob_token_ids[row], logprobs.logprobs[row], logprobs.sampled_token_ranks[row])
                    )
                if not accepted[row]:
                    active[row] = False
        return DraftSample(outputs, logprob_rows if wants_logprobs else None)

    def _verify_position(
        self, logits: torch.Tensor, md: SamplingMetadata, draft_token_ids: torch.Tensor
    ) -> tuple[Any, LogprobsLists | None]:
        """One position for the whole batch: processors, penalties, rejection sampling, logprobs."""
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if md.max_num_logprobs is not None else None
        logits = logits.float()
        if md.allowed_token_ids_mask is not None:
            logits.masked_fill_(md.allowed_token_ids_mask, float("-inf"))
        if md.logitsprocs is not None:
            logits = md.logitsprocs.apply_non_argmax_invariant(logits)
        if not md.no_penalties:
            logits = apply_penalties(logits, md)
        result = self.rejection_sampler.verify(logits, md, draft_token_ids.to(logits.device))
        if raw_logprobs is None:
            return result, None
        t = gather_logprobs(raw_logprobs, md.max_num_logprobs or 0, result.token_ids)
        return result, LogprobsLists(t.logprob_token_ids.tolist(), t.logprobs.tolist(), t.selected_token_ranks.tolist())

    # ------------------------------------------------------------------ drafting
    def propose(self, batch: InputBatch, req_ids: Sequence[str], samples: np.ndarray) -> dict[str, list[int]]:
        """The next step's drafts for the rows that sampled, from their histories; each request drafts at most
        ``num_speculative_tokens``, nothing past ``max_model_len``, and at most ``max_tokens - outputs - 1``
        (the step that verifies ``D`` drafts emits up to ``D + 1`` tokens)."""
        rows: list[int] = []
        caps: list[int] = []
        for row in np.flatnonzero(samples[: len(req_ids)]).tolist():
            state = batch.state_at(row)
            num_tokens = int(batch.num_tokens[row])
            cap = self.max_model_len - num_tokens
            max_tokens = state.sampling_params.max_tokens
            if max_tokens is not None:
                cap = min(cap, max_tokens - len(state.output_token_ids) - 1)
            rows.append(row)
            caps.append(cap)
        drafts = self.proposer.propose(batch.token_ids, batch.num_tokens, rows, caps)
        return {req_ids[row]: tokens for row, tokens in drafts.items()}
