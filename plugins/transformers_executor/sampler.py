"""The sampler: from one row of logits per request to one token per request (vLLM V1 order).

1. raw logprobs (``log_softmax`` of the model's logits, before any processing) when a request wants logprobs:
   returned logprobs are the *raw* model logprobs (vLLM's default ``logprobs_mode="raw_logprobs"``; ``raw_logits``
   returns the logits themselves);
2. ``allowed_token_ids`` masks, then the non-argmax-invariant logits processors (min-tokens, logit bias, ...);
3. repetition, frequency and presence penalties;
4. greedy rows take the argmax; random rows are divided by their temperature, pass the argmax-invariant
   processors (min-p), top-k and top-p, and are sampled by an exponential race (``argmax(p / q)`` with
   ``q = -log(U) ~ Exp(1)``, the Gumbel-max trick). A request with a seed draws ``U`` from its own
   ``torch.Generator``, so its tokens do not depend on which other requests share the batch.

``logprobs_mode="processed_logprobs"`` / ``"processed_logits"`` (vLLM's) return instead the values sampled from:
after stages 2-4, i.e. the temperature-scaled logits with min-p, top-k and top-p applied (tokens they exclude at
-inf; the logits before temperature for greedy rows), normalized with ``log_softmax`` for ``processed_logprobs``.

Fast path: a batch with no logprobs, no ``allowed_token_ids`` and no penalties skips those stages; an all-greedy
one is then the processors and one argmax, an all-random one without top-k/top-p one temperature division, the
processors, a softmax and one exponential race, all in place (the same operations as the general path, so the
same tokens for the same generator states).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch

from vllite.protocol import LogprobsTensors

_SAMPLING_EPS = 1e-5
_TINY = torch.finfo(torch.float32).tiny

#: A banned-token mask ``[B, V]`` (True = banned), or a function that waits for it: structured outputs' grammar
#: bitmask is still being filled on another thread when sampling starts, and the fast path draws its random
#: numbers before asking for it.
TokenMask: TypeAlias = "torch.Tensor | Callable[[], torch.Tensor | None]"


def resolve_token_mask(token_mask: TokenMask | None) -> torch.Tensor | None:
    """The mask itself (waiting for it when it is given as a function)."""
    return token_mask() if callable(token_mask) else token_mask


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs, one entry per batch row, on the sampling device."""

    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [B] or None when no row uses top-p
    top_k: torch.Tensor | None  # [B] int64 (vocab size = disabled) or None
    generators: dict[int, torch.Generator]  # row -> the request's own generator (seeded requests)
    default_generator: torch.Generator | None
    max_num_logprobs: int | None  # None: no row wants logprobs; -1 is resolved to the vocab size
    # row -> the token ids it scores instead of its top-N (``SamplingParams.logprob_token_ids``)
    logprob_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Penalties (None when no row has one): counts come from the padded token tensors (pad = vocab size).
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None  # [B, P] int64
    output_token_ids: torch.Tensor | None = None  # [B, O] int64
    allowed_token_ids_mask: torch.Tensor | None = None  # [B, V] bool, True = not allowed
    logitsprocs: Any = None  # vllite.logits_processor.LogitsProcessors
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None


@dataclass
class SamplerOutput:
    """The sampled token of every row and, when asked, its logprobs (``[B, 1 + N]``, sampled token first)."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs_tensors: LogprobsTensors | None


class Sampler:
    """Turns logits ``[B, V]`` into tokens following each row's sampling parameters; its logprobs hold what
    ``logprobs_mode`` says (see the module docstring)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        self.logprobs_mode = logprobs_mode
        self.processed_logprobs = logprobs_mode.startswith("processed")

    def __call__(
        self, logits: torch.Tensor, md: SamplingMetadata, token_mask: TokenMask | None = None
    ) -> SamplerOutput:
        """Samples one token per row of ``logits`` ``[B, V]`` following ``md``; ``token_mask`` ``[B, V]`` (True =
        banned: structured outputs' grammar bitmask) applies after the processors and penalties, before sampling."""
        if md.max_num_logprobs is None and md.allowed_token_ids_mask is None and md.no_penalties:
            return SamplerOutput(self.sample_fast(logits, md, token_mask), None)
        raw_logprobs = None
        if md.max_num_logprobs is not None and not self.processed_logprobs:
            raw_logprobs = to_logprobs(logits.float(), self.logprobs_mode, copy=True)
        logits = logits.float()
        if md.allowed_token_ids_mask is not None:
            logits.masked_fill_(md.allowed_token_ids_mask, float("-inf"))
        if md.logitsprocs is not None:
            logits = md.logitsprocs.apply_non_argmax_invariant(logits)
        if not md.no_penalties:
            logits = apply_penalties(logits, md)
        mask = resolve_token_mask(token_mask)
        if mask is not None:
            logits.masked_fill_(mask, float("-inf"))
        keep = md.max_num_logprobs is not None and self.processed_logprobs
        sampled, processed = self.sample_keeping_processed(logits, md, keep)
        logprobs = None
        if raw_logprobs is None and processed is not None:
            raw_logprobs = to_logprobs(processed, self.logprobs_mode)
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, md.max_num_logprobs or 0, sampled, md.logprob_token_ids)
        return SamplerOutput(sampled, logprobs)

    def sample_fast(
        self, logits: torch.Tensor, md: SamplingMetadata, token_mask: TokenMask | None = None
    ) -> torch.Tensor:
        """Sampling of a batch without logprobs, ``allowed_token_ids`` or penalties (see the module docstring)."""
        logits = logits.float()
        if md.logitsprocs is not None and md.logitsprocs.non_argmax_invariant:
            logits = md.logitsprocs.apply_non_argmax_invariant(logits)
        race = not md.all_greedy and md.all_random and md.top_k is None and md.top_p is None
        # The race's random numbers do not depend on the mask: drawn first, they overlap the grammar's fill.
        noise = exponential_noise(logits, md.generators, md.default_generator) if race else None
        mask = resolve_token_mask(token_mask)
        if mask is not None:
            logits.masked_fill_(mask, float("-inf"))  # in place, as allowed_token_ids: the caller's rows
        if md.all_greedy:
            return logits.argmax(dim=-1)
        if noise is None:
            return self.sample(logits, md)
        logits = logits / md.temperature.unsqueeze(1)
        if md.logitsprocs is not None and md.logitsprocs.argmax_invariant:
            logits = md.logitsprocs.apply_argmax_invariant(logits)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        return probs.div_(noise).argmax(dim=-1)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Greedy rows' argmax and random rows' exponential race (after temperature, processors, top-k/p)."""
        return self.sample_keeping_processed(logits, md, False)[0]

    def sample_keeping_processed(
        self, logits: torch.Tensor, md: SamplingMetadata, keep: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`sample`, and with ``keep`` the logits sampled from (``[B, V]``): a greedy row's as given, a
        random row's after temperature, the argmax-invariant processors and top-k/top-p (excluded tokens -inf)."""
        greedy = None if md.all_random else logits.argmax(dim=-1)
        if md.all_greedy:
            assert greedy is not None
            return greedy, logits if keep else None
        temperature = md.temperature
        if not md.all_random:
            temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
        scaled = logits / temperature.unsqueeze(1)
        if md.logitsprocs is not None:
            scaled = md.logitsprocs.apply_argmax_invariant(scaled)
        scaled = apply_top_k_top_p(scaled, md.top_k, md.top_p)
        probs = scaled.softmax(dim=-1, dtype=torch.float32)
        random = exponential_race(probs, md.generators, md.default_generator)
        if greedy is None:
            return random, scaled if keep else None
        is_greedy = md.temperature < _SAMPLING_EPS
        processed = torch.where(is_greedy.unsqueeze(1), logits, scaled) if keep else None
        return torch.where(is_greedy, greedy, random), processed


def count_nans_in_logits(logits: torch.Tensor, req_ids: list[str]) -> dict[str, int]:
    """``req_id -> NaN count`` of each request's row of the model's ``logits`` (vLLM's ``num_nans_in_logits``,
    with ``$VLLITE_COMPUTE_NANS_IN_LOGITS``)."""
    counts = logits.isnan().sum(dim=-1).tolist()
    return dict(zip(req_ids, counts, strict=False))


def to_logprobs(logits: torch.Tensor, logprobs_mode: str, copy: bool = False) -> torch.Tensor:
    """What ``logprobs_mode`` returns of float32 ``logits``: their ``log_softmax`` for ``*_logprobs``, the logits
    themselves for ``*_logits`` (a copy with ``copy``, when later stages change them in place)."""
    if logprobs_mode.endswith("_logits"):
        return logits.clone() if copy else logits
    return torch.log_softmax(logits, dim=-1)


def exponential_race(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default: torch.Generator | None,
    *,
    in_place: bool = False,
) -> torch.Tensor:
    """Samples one index per row from ``probs`` as ``argmax(probs / q)``, ``q ~ Exp(1)`` (row ``i`` draws ``q``
    from ``generators[i]`` when it has one, so its result depends only on its own generator's state). With
    ``in_place`` ``probs`` is overwritten."""
    q = exponential_noise(probs, generators, default)
    return (probs.div_(q) if in_place else probs.div(q)).argmax(dim=-1)


def exponential_noise(
    like: torch.Tensor, generators: dict[int, torch.Generator], default: torch.Generator | None
) -> torch.Tensor:
    """The race's ``q ~ Exp(1)``, shaped as ``like``: row ``i`` from ``generators[i]`` when it has one, the other
    rows from ``default``."""
    q = torch.empty(like.shape, dtype=torch.float32, device=like.device)
    if len(generators) != like.shape[0]:
        q.uniform_(generator=default)
    for row, generator in generators.items():
        draw_uniform_(q[row], generator)
    return uniform_to_exponential_(q)


def draw_uniform_(row: torch.Tensor, generator: torch.Generator | None) -> None:
    """One request's draw for one sampled token (how a seeded request's generator advances per token)."""
    row.uniform_(generator=generator)


def uniform_to_exponential_(q: torch.Tensor) -> torch.Tensor:
    """``U ~ Uniform[0, 1)`` into ``-log(U) ~ Exp(1)`` in place (``U`` clamped from 0: every ``q`` finite). The
    same distribution as ``Tensor.exponential_``, at about a fifth of its CPU cost (~4 against ~19 ns per element:
    20 ms a step for 256 rows of a 4,096-token vocabulary)."""
    return q.clamp_(min=_TINY).log_().neg_()


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Masks (to -inf) every token outside the top ``k`` and outside the smallest set with mass >= ``p``.

    Ties at the top-k threshold are all kept. A ``k`` of the vocab size or a ``p`` of 1 disables that filter.
    """
    if k is None and p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        vocab = logits.shape[-1]
        kth = (vocab - k.clamp(1, vocab)).unsqueeze(1)
        threshold = logits_sort.gather(1, kth)
        logits_sort.masked_fill_(logits_sort < threshold, float("-inf"))
    if p is not None:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        mask = probs_sum <= 1 - p.unsqueeze(1)
        mask[:, -1] = False  # always keep the most likely token
        logits_sort.masked_fill_(mask, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts of each token id per row (``token_ids`` padded with ``vocab_size``, which is dropped)."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output tokens), then frequency and presence (output tokens only) penalties."""
    assert md.prompt_token_ids is not None and md.output_token_ids is not None
    assert md.frequency_penalties is not None and md.presence_penalties is not None
    assert md.repetition_penalties is not None
    vocab_size = logits.shape[-1]
    prompt_mask = _bin_counts(md.prompt_token_ids, vocab_size) > 0
    output_counts = _bin_counts(md.output_token_ids, vocab_size)
    output_mask = output_counts > 0
    rep = md.repetition_penalties.unsqueeze(1).expand_as(logits)
    rep = torch.where(prompt_mask | output_mask, rep, torch.ones_like(rep))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalties.unsqueeze(1) * output_counts
    logits = logits - md.presence_penalties.unsqueeze(1) * output_mask
    return logits


def gather_logprobs(
    logprobs: torch.Tensor,
    num_logprobs: int,
    token_ids: torch.Tensor,
    fixed_token_ids: dict[int, list[int]] | None = None,
) -> LogprobsTensors:
    """Per row: the logprob and rank (1 = best; ties count as better) of ``token_ids``, then the top
    ``num_logprobs`` (``-1`` = the whole vocabulary). Tensors ``[B, 1 + N]``; ranks ``[B]``.

    A row in ``fixed_token_ids`` gets the logprobs of those ids in its columns ``1..k`` instead of its top-k
    (``num_logprobs`` covers its ``k``; the frontend reads only a request's own columns)."""
    if num_logprobs < 0:
        num_logprobs = logprobs.shape[-1]
    token_ids = token_ids.to(torch.int64).unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(-1)
    top_logprobs, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)
    for row, ids_wanted in (fixed_token_ids or {}).items():
        wanted = torch.tensor(ids_wanted, dtype=torch.int64, device=logprobs.device)
        top_ids[row, : wanted.numel()] = wanted
        top_logprobs[row, : wanted.numel()] = logprobs[row, wanted]
    ids = torch.cat((token_ids, top_ids), dim=1)
    values = torch.cat((token_logprobs, top_logprobs), dim=1)
    return LogprobsTensors(ids, values, ranks)
