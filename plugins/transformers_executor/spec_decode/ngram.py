"""The prompt-lookup (n-gram) drafter: propose the tokens that followed the latest earlier occurrence of a
request's last ``n`` tokens.

For each request the drafter looks for the longest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` such
that the request's last ``n`` tokens (prompt and output together) occurred earlier, takes the most recent
such occurrence, and proposes up to ``k`` tokens that followed it (fewer when the history ends first). This is
vLLM's ``NgramProposer`` rule. The search is vectorised with numpy: one comparison of the whole history
against the last token, then candidate matches are extended backwards one token at a time, so the cost is one
pass over the history plus work proportional to the number of partial matches.
"""

from __future__ import annotations

import numpy as np


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` draft tokens for the history ``tokens`` (1-D int array); empty when no n-gram of length
    ``min_n .. max_n`` ending at the last token occurred earlier, or ``k <= 0``.

    The longest matching ``n`` wins; among its occurrences, the most recent one (a match may overlap the
    suffix itself but never be it)."""
    length = tokens.shape[0]
    if k <= 0 or length < min_n + 1:
        return tokens[:0]
    # End positions e (< length - 1) of the matches of the suffix of length n, n = 1, 2, ...
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    best_end = -1
    n = 1
    while ends.size:
        if n >= min_n:
            best_end = int(ends[-1])
        if n == max_n:
            break
        starts = ends - n  # the token before each match must equal the token before the suffix
        keep = starts >= 0
        if not keep.all():
            ends, starts = ends[keep], starts[keep]
        ends = ends[tokens[starts] == tokens[length - 1 - n]]
        n += 1
    if best_end < 0:
        return tokens[:0]
    return tokens[best_end + 1 : best_end + 1 + k]


class NgramProposer:
    """Proposes drafts for the requests of a batch from their own token histories (no model).

    ``propose`` is called once per step after sampling, with each request's history and how many drafts it
    may take (the engine caps it by ``num_speculative_tokens``, the context length and the request's
    remaining ``max_tokens``).
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({prompt_lookup_min}) must be >= 1 and <= prompt_lookup_max ({prompt_lookup_max})."
            )
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_one(self, tokens: np.ndarray, max_drafts: int | None = None) -> list[int]:
        """The drafts for one history (at most ``min(k, max_drafts)``)."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        return find_ngram_draft(tokens, self.min_n, self.max_n, k).tolist()

    def propose(
        self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: list[int], max_drafts: list[int]
    ) -> dict[int, list[int]]:
        """Drafts for ``rows`` of a ``[num_rows, max_len]`` token matrix whose row ``r`` holds
        ``num_tokens[r]`` known tokens; ``max_drafts[i]`` caps the drafts of ``rows[i]``. Rows without a
        draft are left out of the result."""
        drafts: dict[int, list[int]] = {}
        for row, cap in zip(rows, max_drafts):
            if cap <= 0:
                continue
            draft = self.propose_one(token_ids[row, : int(num_tokens[row])], cap)
            if draft:
                drafts[row] = draft
        return drafts
