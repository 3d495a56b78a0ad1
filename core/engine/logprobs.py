"""``LogprobsProcessor``: turns the engine's logprob rows and tensors into per-position ``Logprob`` dicts."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from vllite.outputs import Logprob, PromptLogprobs, SampleLogprobs
from vllite.protocol import EngineCoreOutput, EngineCoreRequest, LogprobsLists, LogprobsTensors


def decode_tokens(tokenizer: Any, token_ids: Sequence[int], skip_special_tokens: bool = False) -> list[str | None]:
    """Each token's own text (``None`` for all without a tokenizer); partial characters decode to U+FFFD."""
    if tokenizer is None:
        return [None] * len(token_ids)
    return [tokenizer.decode([t], skip_special_tokens=skip_special_tokens) for t in token_ids]


def make_logprob_dict(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    rank: int,
    decoded: Sequence[str | None],
    *,
    fixed: bool = False,
) -> dict[int, Logprob]:
    """One position: the chosen token (first, with its ``rank``) then the top tokens ranked 1, 2, ...

    When the chosen token is also among the top tokens its entry is the top-k one (same logprob and rank).
    ``fixed``: the columns after the first are the request's ``logprob_token_ids``, whose ranks the engine does not
    compute (``rank=None``); the chosen token keeps its rank when it is one of them.
    """
    if fixed:
        entries = {
            int(tid): Logprob(logprob=float(lp), rank=None, decoded_token=text)
            for tid, lp, text in zip(token_ids[1:], logprobs[1:], decoded[1:])
        }
        entries[int(token_ids[0])] = Logprob(logprob=float(logprobs[0]), rank=int(rank), decoded_token=decoded[0])
        return entries
    ranks = itertools.chain((rank,), range(1, len(token_ids)))
    return {
        int(tid): Logprob(logprob=float(lp), rank=int(r), decoded_token=text)
        for tid, lp, r, text in zip(token_ids, logprobs, ranks, decoded)
    }


class LogprobsProcessor:
    """Collects sample logprobs (with ``cumulative_logprob``) and prompt logprobs of one request.

    ``logprobs`` is None unless ``SamplingParams.logprobs`` was set; likewise ``prompt_logprobs``, whose first
    entry is None (the first prompt token has no logprob).
    """

    def __init__(
        self, tokenizer: Any, num_logprobs: int | None, num_prompt_logprobs: int | None, *, fixed_ids: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        self.fixed_ids = fixed_ids  # the columns are the request's logprob_token_ids, not its top-N
        self.num_prompt_logprobs = num_prompt_logprobs
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0
        self.prompt_logprobs: PromptLogprobs | None = None if num_prompt_logprobs is None else []

    @classmethod
    def from_new_request(cls, tokenizer: Any, request: EngineCoreRequest) -> LogprobsProcessor:
        params = request.params
        return cls(tokenizer, params.logprobs, params.prompt_logprobs, fixed_ids=bool(params.logprob_token_ids))

    def update_from_output(self, output: EngineCoreOutput) -> None:
        if output.new_logprobs is not None and self.logprobs is not None:
            self._update_sample_logprobs(output.new_logprobs)
        if output.new_prompt_logprobs_tensors is not None and self.prompt_logprobs is not None:
            self._update_prompt_logprobs(output.new_prompt_logprobs_tensors)

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs gathered so far, handed out once (DELTA outputs send them a single time)."""
        plp = self.prompt_logprobs
        if plp:
            self.prompt_logprobs = []
        return plp

    def _update_sample_logprobs(self, lists: LogprobsLists) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        # The engine returns the batch's largest top-N for every row; keep this request's own N (+ the sample).
        width = _columns(self.num_logprobs)
        for token_ids, logprobs, rank in zip(lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks):
            token_ids, logprobs = token_ids[:width], logprobs[:width]
            self.cumulative_logprob += float(logprobs[0])
            decoded = decode_tokens(self.tokenizer, token_ids)
            self.logprobs.append(make_logprob_dict(token_ids, logprobs, rank, decoded, fixed=self.fixed_ids))

    def _update_prompt_logprobs(self, tensors: LogprobsTensors) -> None:
        assert self.prompt_logprobs is not None
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)
        token_ids = _to_list(tensors.logprob_token_ids)
        logprobs = _to_list(tensors.logprobs)
        ranks = _to_list(tensors.selected_token_ranks)
        width = _columns(self.num_prompt_logprobs)
        for ids, lps, rank in zip(token_ids, logprobs, ranks):
            ids, lps = ids[:width], lps[:width]
            self.prompt_logprobs.append(make_logprob_dict(ids, lps, rank, decode_tokens(self.tokenizer, ids)))


def _columns(num: int | None) -> int | None:
    """Columns to keep: the chosen token plus ``num`` top tokens; -1 (whole vocabulary) keeps all."""
    return None if num is None or num < 0 else num + 1


def _to_list(value: Any) -> list[Any]:
    return value.tolist() if hasattr(value, "tolist") else list(value)
