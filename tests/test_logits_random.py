"""Randomized check: random add / remove / move (one-way and swap) sequences through ``BatchUpdateBuilder``
into every builtin processor; after each step each processor's output equals a per-request reference
computed from scratch from that request's parameters, prompt and output so far."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from vllite.builtin_logitsprocs.logit_bias import LogitBiasLogitsProcessor
from vllite.builtin_logitsprocs.min_p import MinPLogitsProcessor
from vllite.builtin_logitsprocs.min_tokens import MinTokensLogitsProcessor
from vllite.builtin_logitsprocs.thinking_budget import FORCE_LOGIT, ThinkingBudgetLogitsProcessor
from vllite.config import ModelConfig, SchedulerConfig, VllmConfig
from vllite.logits_processor import BatchUpdateBuilder, LogitsProcessors, MoveDirectionality
from vllite.sampling_params import SamplingParams

VOCAB = 12
MAX_REQS = 8
EOS, THINK_START, THINK_END = 0, [1], [2, 3]
STEPS_PER_SEED = 1000


@dataclass
class Req:
    params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)


def random_request(rng: random.Random) -> Req:
    extra = None
    if rng.random() < 0.5:
        extra = {"thinking_token_budget": rng.randint(0, 4)}
        if rng.random() < 0.3:
            extra["think_end_token_ids"] = [2]
    params = SamplingParams(
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3, 0.9]),
        logit_bias=(
            {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(rng.randint(1, 3))} if rng.random() < 0.4 else None
        ),
        min_tokens=rng.choice([0, 0, 2, 5]),
        max_tokens=None,
        stop_token_ids=rng.sample(range(4, VOCAB), rng.randint(0, 2)),
        all_stop_token_ids=[EOS],
        extra_args=extra,
    )
    prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 5))]
    if rng.random() < 0.3:
        prompt.insert(rng.randrange(len(prompt) + 1), THINK_START[0])
    output = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 0, 2]))]  # >0: a resumed request
    return Req(params, prompt, output)


# ---------------------------------------------------------------- references, per request, from scratch
def ref_min_p(req: Req, row: torch.Tensor) -> torch.Tensor:
    if not req.params.min_p:
        return row
    probs = torch.softmax(row, dim=-1)
    return row.masked_fill(probs < probs.max() * req.params.min_p, -float("inf"))


def ref_logit_bias(req: Req, row: torch.Tensor) -> torch.Tensor:
    row = row.clone()
    for token, bias in (req.params.logit_bias or {}).items():
        row[token] += bias
    return row


def ref_min_tokens(req: Req, row: torch.Tensor) -> torch.Tensor:
    row = row.clone()
    if len(req.output) < req.params.min_tokens:
        for token in req.params.all_stop_token_ids:
            row[token] = -float("inf")
    return row


def _last(seq: list[int], marker: list[int]) -> int:
    return max((i for i in range(len(seq) - len(marker) + 1) if seq[i : i + len(marker)] == marker), default=-1)


def ref_forced_think_token(req: Req) -> int | None:
    extra = req.params.extra_args or {}
    if extra.get("thinking_token_budget") is None:
        return None
    budget, end = extra["thinking_token_budget"], extra.get("think_end_token_ids", THINK_END)
    seq = req.prompt + req.output
    start_pos = _last(req.prompt, THINK_START)
    in_think = start_pos > _last(req.prompt, end)
    count = len(req.prompt) - start_pos - 1 if in_think else 0
    in_end, emitted = False, 0

    def enter_end(upto: int) -> int:
        done = seq[:upto]
        return next((k for k in range(len(end) - 1, 0, -1) if done[len(done) - k :] == end[:k]), 0)

    if in_think and count >= budget:
        in_end, emitted = True, enter_end(len(req.prompt))
    for i in range(len(req.prompt), len(seq)):
        done = seq[: i + 1]
        if in_end:
            emitted += 1
            if emitted == len(end):
                in_end = in_think = False
                count = 0
        elif in_think:
            if done[-len(end) :] == end:
                in_think, count = False, 0
            else:
                count += 1
        elif done[-1:] == THINK_START:
            in_think, count = True, 0
        if in_think and not in_end and count >= budget:
            in_end, emitted = True, enter_end(i + 1)
    return end[emitted] if in_end else None


def ref_thinking(req: Req, row: torch.Tensor) -> torch.Tensor:
    row = row.clone()
    token = ref_forced_think_token(req)
    if token is not None:
        row[token] = FORCE_LOGIT
    return row


REFERENCES = {
    MinPLogitsProcessor: ref_min_p,
    LogitBiasLogitsProcessor: ref_logit_bias,
    MinTokensLogitsProcessor: ref_min_tokens,
    ThinkingBudgetLogitsProcessor: ref_thinking,
}


# ---------------------------------------------------------------- the persistent batch
class FakeBatch:
    """A condensed persistent batch reporting its changes through a ``BatchUpdateBuilder`` (as the runner)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.slots: list[Req | None] = []
        self.builder = BatchUpdateBuilder()
        self.num_swaps = self.num_moves = 0

    def step(self):
        rng, b = self.rng, self.builder
        for i, req in enumerate(self.slots):
            if req is not None and rng.random() < 0.15:
                b.removed_append(i)
                self.slots[i] = None
        for _ in range(rng.randint(0, 3)):
            if sum(r is not None for r in self.slots) >= MAX_REQS:
                break
            req = random_request(rng)
            slot = b.pop_removed()
            if slot is None:
                slot = len(self.slots)
                self.slots.append(None)
            self.slots[slot] = req
            b.added.append((slot, req.params, req.prompt, req.output))
        # Condense: move the last requests into the holes (one-way moves).
        while None in self.slots:
            hole = self.slots.index(None)
            last = max((i for i, r in enumerate(self.slots) if r is not None), default=-1)
            if last < hole:
                del self.slots[hole:]
                break
            self.slots[hole], self.slots[last] = self.slots[last], None
            b.moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            self.num_moves += 1
        if len(self.slots) >= 2 and rng.random() < 0.5:
            i, j = rng.sample(range(len(self.slots)), 2)
            self.slots[i], self.slots[j] = self.slots[j], self.slots[i]
            b.moved.append((i, j, MoveDirectionality.SWAP))
            self.num_swaps += 1
        return b.get_and_reset(len(self.slots))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny tensors: torch's intra-op threads only add latency (milliseconds per op on a busy machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_builtins_match_per_request_reference(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hf = SimpleNamespace(think_start_token_ids=THINK_START, think_end_token_ids=THINK_END)
    config = VllmConfig(scheduler_config=SchedulerConfig(max_num_seqs=MAX_REQS), model_config=ModelConfig(hf_config=hf))
    procs = [cls(config, torch.device("cpu"), False) for cls in REFERENCES]
    container = LogitsProcessors(procs)
    batch = FakeBatch(rng)
    forced_seen = masked_seen = 0
    for _ in range(STEPS_PER_SEED):
        container.update_state(batch.step())
        reqs = batch.slots
        if not reqs:
            continue
        base = torch.randn(len(reqs), VOCAB, generator=gen) * 2
        min_p = procs[list(REFERENCES).index(MinPLogitsProcessor)]
        assert min_p.min_p_count == int((min_p.min_p_cpu != 0).sum())
        for proc in procs:
            out = proc.apply(base.clone())
            ref = torch.stack([REFERENCES[type(proc)](req, base[i]) for i, req in enumerate(reqs)])
            assert torch.allclose(out, ref), f"{type(proc).__name__}: {out} != {ref}"
        final = container.apply(base.clone())
        forced_seen += int((final == FORCE_LOGIT).sum())
        masked_seen += int(torch.isinf(final).sum())
        # Sample from the processed distribution (Gumbel-max) and append to the live output lists.
        gumbel = -torch.log(-torch.log(torch.rand(final.shape, generator=gen).clamp_min(1e-20)))
        for req, token in zip(reqs, (final + gumbel).argmax(-1).tolist()):
            req.output.append(token)
    assert batch.num_moves > 100 and batch.num_swaps > 100 and forced_seen > 50 and masked_seen > 100
