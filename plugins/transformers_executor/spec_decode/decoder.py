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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllite.plugins.transformers_executor.prompt_logprobs import compute_prompt_logprobs
from vllite.plugins.transformers_executor.sampler import SamplingMetadata, apply_penalties, gather_logprobs
from vllite.plugins.transformers_executor.spec_decode.ngram import NgramProposer
from vllite.plugins.transformers_executor.spec_decode.rejection_sampler import NO_DRAFT, RejectionSampler
from vllite.protocol import LogprobsLists
from vllite.sched.output import ModelRunnerOutput
from vllite.structured_output.bitmask import draft_token_mask

if TYPE_CHECKING:
    from vllite.plugins.transformers_executor.input_batch import CachedRequestState, InputBatch
    from vllite.sched.output import SchedulerOutput
    from vllite.speculative_config import SpeculativeConfig

#: Recomputes a metadata's penalty token tensors from the batch's current tokens (in place).
PenaltyRefresher = Callable[[SamplingMetadata], None]


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
    def write_drafts(batch: InputBatch, scheduled: dict[str, list[int]], req_ids: Sequence[str]) -> np.ndarray | None:
        """Writes each scheduled request's drafts into its row after its known tokens (``num_tokens`` is not
        moved: drafts are not known tokens) and returns the number of drafts per row (``[num_reqs]``), or
        ``None`` when the step has no drafts."""
        if not scheduled:
            return None
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        for row, req_id in enumerate(req_ids):
            drafts = scheduled.get(req_id)
            if drafts:
                start = int(batch.num_tokens[row])
                batch.token_ids[row, start : start + len(drafts)] = drafts
                num_drafts[row] = len(drafts)
        return num_drafts

    @staticmethod
    def logits_indices(query_start_loc: Any, num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The packed-token indices whose logits are kept (each request's last ``1 + D`` positions, in order),
        and the index of each request's first kept row among them (``query_start_loc``: array or CPU tensor)."""
        ends = np.asarray(query_start_loc)[1:].astype(np.int64)
        counts = num_drafts + 1
        first_rows = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        offsets = np.arange(int(counts.sum())) - np.repeat(first_rows, counts)
        indices = np.repeat(ends - counts, counts) + offsets
        return indices, first_rows

    # ------------------------------------------------------------------ verification
    def finish_step(
        self,
        runner: Any,
        logits: torch.Tensor,
        first_rows: np.ndarray,
        num_drafts: np.ndarray,
        samples: np.ndarray,
        req_ids: list[str],
        prompt_plan: list[Any] | None,
        scheduler_output: SchedulerOutput,
    ) -> ModelRunnerOutput:
        """The model runner's step after the forward pass when drafts were scheduled: verify them (``sample``),
        drop the rows a logits processor failed on, compute prompt logprobs from the rows after the kept ones,
        and draft the next step. ``runner`` is the :class:`~vllite.plugins.transformers_executor.model_runner.
        ModelRunner` (its batch, requests, sampling metadata, penalties and failed-row bookkeeping are used).
        Structured outputs' grammar bitmask (``scheduler_output.grammar_output``) constrains every position."""
        batch = runner.input_batch
        num_kept = len(first_rows) + int(num_drafts.sum())
        grammar_output = scheduler_output.grammar_output
        token_mask = None
        if grammar_output is not None:
            token_mask = draft_token_mask(grammar_output, req_ids, num_drafts.tolist(), logits.shape[-1], logits.device)
        prompt_logprobs = compute_prompt_logprobs(prompt_plan or [], logits[num_kept:], runner.requests)
        md = runner._sampling_metadata(samples)
        num_reqs = batch.num_reqs
        out = self.sample(
            logits[:num_kept],
            first_rows,
            num_drafts,
            batch,
            samples,
            md,
            lambda position_md: runner._add_penalties(position_md, num_reqs),
            token_mask,
        )
        failed = runner._take_failed_requests(req_ids, samples)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=runner._req_id_to_index(),
            sampled_token_ids=[tokens if samples[row] else [] for row, tokens in enumerate(out.sampled_token_ids)],
            logprobs=out.logprobs(samples),
            prompt_logprobs_dict=prompt_logprobs,
            failed_requests=failed,
            draft_token_ids=self.propose(batch, req_ids, samples),
        )

    def sample(
        self,
        logits: torch.Tensor,
        first_rows: np.ndarray,
        num_drafts: np.ndarray,
        batch: InputBatch,
        samples: np.ndarray,
        md: SamplingMetadata,
        refresh_penalties: PenaltyRefresher,
        token_mask: torch.Tensor | None = None,
    ) -> DraftSample:
        """Verifies every request's drafts (see the module docstring). ``logits`` holds the kept rows
        (``logits_indices``); ``samples[r]`` says whether row ``r`` samples at all this step; ``md`` is the
        step's sampling metadata for the sampling rows; ``token_mask`` (True = banned, aligned with ``logits``)
        bans tokens after the processors and penalties. Emitted tokens are appended to the requests' live
        output lists and to the batch as they are decided."""
        num_reqs = len(num_drafts)
        active = samples[:num_reqs].copy()
        outputs: list[list[int]] = [[] for _ in range(num_reqs)]
        logprob_rows: list[list[tuple[list[int], list[float], int]]] = [[] for _ in range(num_reqs)]
        draft_matrix = np.full((num_reqs, int(num_drafts.max(initial=0)) + 1), NO_DRAFT, dtype=np.int64)
        for row in np.flatnonzero(num_drafts):
            start = int(batch.num_tokens[row])
            draft_matrix[row, : num_drafts[row]] = batch.token_ids[row, start : start + num_drafts[row]]
        device = logits.device
        wants_logprobs = md.max_num_logprobs is not None
        for position in range(draft_matrix.shape[1]):
            rows = np.flatnonzero(active)
            if rows.size == 0:
                break
            position_md = md
            if position > 0:
                # The accepted drafts are now in the live output lists and the batch: processors and
                # penalties look at the history up to this position.
                if md.logitsprocs is not None:
                    md.logitsprocs.update_state(None)
                if md.generators or not md.no_penalties:
                    position_md = replace(md, generators={r: g for r, g in md.generators.items() if active[r]})
                if not md.no_penalties:
                    refresh_penalties(position_md)
            index = torch.from_numpy(first_rows + np.minimum(position, num_drafts)).to(device)
            drafts = torch.from_numpy(draft_matrix[:, position])
            mask = token_mask[index] if token_mask is not None else None
            result, logprobs = self._verify_position(logits[index], position_md, drafts, mask)
            tokens = result.token_ids.cpu().numpy()
            batch.append_tokens(rows, tokens[rows])
            states = batch.states
            for row, token in zip(rows.tolist(), tokens[rows].tolist()):
                outputs[row].append(token)
                state: CachedRequestState | None = states[row]
                assert state is not None
                state.output_token_ids.append(token)  # the live list the processors read
                if logprobs is not None:
                    logprob_rows[row].append(
                        (logprobs.logprob_token_ids[row], logprobs.logprobs[row], logprobs.sampled_token_ranks[row])
                    )
            active[rows[~result.accepted.cpu().numpy()[rows]]] = False
        return DraftSample(outputs, logprob_rows if wants_logprobs else None)

    def _verify_position(
        self, logits: torch.Tensor, md: SamplingMetadata, draft_token_ids: torch.Tensor, mask: torch.Tensor | None
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
        if mask is not None:
            logits = logits.masked_fill(mask, float("-inf"))
        result = self.rejection_sampler.verify(logits, md, draft_token_ids.to(logits.device))
        if raw_logprobs is None:
            return result, None
        t = gather_logprobs(raw_logprobs, md.max_num_logprobs or 0, result.token_ids, md.logprob_token_ids)
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
