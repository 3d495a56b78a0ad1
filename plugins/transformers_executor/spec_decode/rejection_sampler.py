"""Rejection sampling of draft tokens, one draft position at a time, keeping the target distribution exact.

At one position every row of the batch has final logits (after its logits processors and penalties, computed
with the token history up to that position) and possibly a draft token ``x`` (``-1``: no draft, the row samples
its bonus or final token). Each row emits one token:

- greedy rows (temperature 0): the argmax ``a``; the draft is accepted iff ``x == a``;
- random rows: ``p`` is the row's sampling distribution (temperature, argmax-invariant processors, top-k,
  top-p, softmax). An n-gram draft is a point mass ``q = δ_x``, so speculative sampling's acceptance
  probability ``min(1, p(x) / q(x))`` is ``p(x)``: the draft is accepted iff ``u < p(x)`` with
  ``u ~ U[0, 1)``. On rejection the token is drawn from the residual ``norm(max(0, p - q))``, which is
  ``p`` with ``x`` removed and renormalised. A row without a draft draws from ``p``.

So the emitted token is distributed exactly as ``p`` (``p(x)`` for ``x``; ``(1 - p(x)) · p(y) / (1 - p(x))`` for
every other ``y``), which is the guarantee of speculative sampling. A seeded request draws its uniform and
its sample from its own generator, and only at positions where it is still verifying, so its tokens do not
depend on the other requests of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllite.plugins.transformers_executor.sampler import (
    SamplingMetadata,
    apply_top_k_top_p,
    exponential_race,
)

_SAMPLING_EPS = 1e-5
NO_DRAFT = -1


@dataclass
class PositionResult:
    """What each row emits at one draft position: its token, and whether that token is its accepted draft."""

    token_ids: torch.Tensor  # [B] int64
    accepted: torch.Tensor  # [B] bool; False for rows without a draft


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Each row's sampling distribution from its processed logits: temperature (greedy rows use 1), the
    argmax-invariant logits processors, top-k and top-p, softmax (float32)."""
    temperature = torch.where(md.temperature < _SAMPLING_EPS, 1.0, md.temperature)
    logits = logits / temperature.unsqueeze(1)
    if md.logitsprocs is not None:
        logits = md.logitsprocs.apply_argmax_invariant(logits)
    logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
    return logits.softmax(dim=-1, dtype=torch.float32)


def _uniform(num_rows: int, md: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One ``U[0, 1)`` draw per row; a row with its own generator (``md.generators``) draws from it."""
    u = torch.empty(num_rows, dtype=torch.float32, device=device)
    if len(md.generators) != num_rows:
        u.uniform_(generator=md.default_generator)
    for row, generator in md.generators.items():
        u[row : row + 1].uniform_(generator=generator)
    return u


class RejectionSampler:
    """Verifies one draft position for a whole batch (see the module docstring for the rule)."""

    def verify(self, logits: torch.Tensor, md: SamplingMetadata, draft_token_ids: torch.Tensor) -> PositionResult:
        """Tokens for one position. ``logits`` ``[B, V]`` are processed up to (not including) temperature;
        ``draft_token_ids`` ``[B]`` holds each row's draft at this position or ``-1``. ``md.generators`` must
        hold only the rows that verify at this position (so idle seeded rows draw nothing)."""
        has_draft = draft_token_ids >= 0
        safe_draft = draft_token_ids.clamp(min=0).unsqueeze(1)
        greedy_tokens = None if md.all_random else logits.argmax(dim=-1)
        if md.all_greedy:
            assert greedy_tokens is not None
            return PositionResult(greedy_tokens, has_draft & (greedy_tokens == draft_token_ids))
        probs = sampling_probs(logits, md)
        u = _uniform(probs.shape[0], md, probs.device)
        draft_probs = probs.gather(1, safe_draft).squeeze(1)
        accepted = has_draft & (u < draft_probs)
        # Rejected: sample from p without the draft token (the race renormalises implicitly).
        rejected = has_draft & ~accepted
        if bool(rejected.any()):
            probs = probs.scatter(1, safe_draft, torch.where(rejected, 0.0, draft_probs).unsqueeze(1))
        sampled = exponential_race(probs, md.generators, md.default_generator)
        tokens = torch.where(accepted, draft_token_ids, sampled)
        if greedy_tokens is not None:
            greedy = md.temperature < _SAMPLING_EPS
            tokens = torch.where(greedy, greedy_tokens, tokens)
            accepted = torch.where(greedy, has_draft & (greedy_tokens == draft_token_ids), accepted)
        return PositionResult(tokens, accepted)
