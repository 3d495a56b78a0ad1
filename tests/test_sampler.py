"""The sampler against naive per-row references: top-k/top-p, penalties, logprobs, seeded sampling."""

from __future__ import annotations

import pytest
import torch
from test_executor_support import single_thread  # noqa: F401  (autouse fixture)

from vllite.plugins.transformers_executor.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p,
    exponential_race,
    gather_logprobs,
)

V = 50


def _md(temperature: list[float], **kw: object) -> SamplingMetadata:
    t = torch.tensor(temperature)
    greedy = t < 1e-5
    base = dict(
        temperature=t,
        all_greedy=bool(greedy.all()),
        all_random=bool((~greedy).all()),
        top_p=None,
        top_k=None,
        generators={},
        default_generator=torch.Generator().manual_seed(0),
        max_num_logprobs=None,
    )
    base.update(kw)
    return SamplingMetadata(**base)  # type: ignore[arg-type]


def _naive_top_k_top_p(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    out = row.clone()
    order = sorted(range(len(row)), key=lambda i: -float(row[i]))
    for i in order[k:]:
        out[i] = float("-inf")
    probs = torch.softmax(out, dim=-1)
    mass = 0.0
    for i in order:
        if mass >= p:
            out[i] = float("-inf")
        mass += float(probs[i])
    return out


def test_top_k_top_p_match_naive_reference() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=g) * 3
    k = torch.tensor([1, 5, V, 10, 3, V])
    p = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.999, 1.0])
    got = apply_top_k_top_p(logits.clone(), k, p)
    for i in range(6):
        expected = _naive_top_k_top_p(logits[i], int(k[i]), float(p[i]))
        assert torch.equal(torch.isinf(got[i]), torch.isinf(expected)), i
        kept = ~torch.isinf(expected)
        assert torch.allclose(got[i][kept], logits[i][kept])
    assert (~torch.isinf(got[0])).sum() == 1 and torch.equal(got[5], logits[5])
    assert apply_top_k_top_p(logits, None, None) is logits


def test_penalties_match_naive_reference() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, V, generator=g) * 2
    prompts = [[1, 2, 3, 3], [4], [7, 8]]
    outputs = [[3, 9, 9, 9], [], [8, 8, 10]]
    pad = V
    width = 4
    prompt_t = torch.tensor([r + [pad] * (width - len(r)) for r in prompts])
    output_t = torch.tensor([r + [pad] * (width - len(r)) for r in outputs])
    freq, pres, rep = [0.5, 0.0, -0.3], [1.0, 0.7, 0.2], [1.3, 2.0, 0.8]
    md = _md(
        [1.0] * 3,
        frequency_penalties=torch.tensor(freq),
        presence_penalties=torch.tensor(pres),
        repetition_penalties=torch.tensor(rep),
        prompt_token_ids=prompt_t,
        output_token_ids=output_t,
    )
    got = apply_penalties(logits.clone(), md)
    for i in range(3):
        expected = logits[i].clone()
        for tok in range(V):
            if tok in prompts[i] or tok in outputs[i]:
                x = float(expected[tok])
                expected[tok] = x / rep[i] if x > 0 else x * rep[i]
            count = outputs[i].count(tok)
            expected[tok] -= freq[i] * count + pres[i] * (count > 0)
        assert torch.allclose(got[i], expected, atol=1e-6), i


def test_gather_logprobs_ranks_and_sizes() -> None:
    logprobs = torch.log_softmax(torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]]), dim=-1)
    t = gather_logprobs(logprobs, 2, torch.tensor([2, 0]))
    assert t.logprob_token_ids.tolist() == [[2, 0, 2], [0, 2, 3]]
    assert t.selected_token_ranks.tolist() == [2, 4]  # ties count as ranking above
    assert torch.allclose(t.logprobs[:, 0], logprobs[[0, 1], [2, 0]])
    assert gather_logprobs(logprobs, -1, torch.tensor([0, 0])).logprobs.shape == (2, 5)
    assert gather_logprobs(logprobs, 0, torch.tensor([0, 0])).logprobs.shape == (2, 1)


def test_exponential_race_follows_the_distribution() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).repeat(4000, 1)
    drawn = exponential_race(probs, {}, torch.Generator().manual_seed(3))
    freq = torch.bincount(drawn, minlength=4).float() / 4000
    assert torch.allclose(freq, probs[0], atol=0.03)
    assert freq[3] == 0


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    g = torch.Generator().manual_seed(4)
    row = torch.randn(V, generator=g)
    others = torch.randn(5, V, generator=g)

    def draw(batch: torch.Tensor, row_index: int) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        tokens = []
        for _ in range(10):
            md = _md(
                [0.8] * batch.shape[0],
                generators={row_index: gen},
                default_generator=torch.Generator().manual_seed(len(tokens)),
            )
            tokens.append(int(Sampler()(batch.clone(), md).sampled_token_ids[row_index]))
        return tokens

    alone = draw(row.unsqueeze(0), 0)
    assert draw(torch.cat([others[:2], row.unsqueeze(0), others[2:]]), 2) == alone
    assert draw(torch.cat([row.unsqueeze(0), others]), 0) == alone
    assert len(set(alone)) > 1


def test_sampler_mixes_greedy_and_random_and_returns_raw_logprobs() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=g)
    mask = torch.ones(3, V, dtype=torch.bool)
    mask[1, [7, 8]] = False
    mask[[0, 2]] = False
    md = _md(
        [0.0, 1.0, 0.0],
        max_num_logprobs=3,
        allowed_token_ids_mask=mask,
        repetition_penalties=torch.tensor([1.0, 1.0, 5.0]),
        frequency_penalties=torch.zeros(3),
        presence_penalties=torch.zeros(3),
        prompt_token_ids=torch.full((3, 1), V),
        output_token_ids=torch.tensor([[V], [V], [int(logits[2].argmax())]]),
    )
    out = Sampler()(logits.clone(), md)
    assert int(out.sampled_token_ids[0]) == int(logits[0].argmax())
    assert int(out.sampled_token_ids[1]) in (7, 8)  # allowed_token_ids
    assert int(out.sampled_token_ids[2]) != int(logits[2].argmax())  # repetition penalty on a positive max
    raw = torch.log_softmax(logits, dim=-1)
    t = out.logprobs_tensors
    assert t is not None
    assert torch.allclose(t.logprobs[:, 0], raw.gather(1, out.sampled_token_ids.unsqueeze(1))[:, 0])
    assert t.logprob_token_ids[:, 1:].tolist() == torch.topk(raw, 3).indices.tolist()


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature: float) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(6000, 1)
    md = _md([temperature] * 6000, default_generator=torch.Generator().manual_seed(6))
    drawn = Sampler()(logits, md).sampled_token_ids
    freq = torch.bincount(drawn, minlength=3).float() / 6000
    assert torch.allclose(freq, torch.softmax(logits[0] / temperature, dim=-1), atol=0.03)


@pytest.mark.parametrize("temperature", [[0.0, 0.0, 0.0], [0.7, 1.3, 1.0], [0.0, 0.9, 1.1]])
def test_fast_path_gives_the_general_paths_tokens(temperature):
    """A batch without logprobs, allowed-token masks or penalties takes the fast path; its tokens are the general
    path's for the same generator states (seeded rows and the default generator alike)."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))

    def run(fast: bool) -> torch.Tensor:
        md = _md(temperature, generators={1: torch.Generator().manual_seed(7)})
        sampler = Sampler()
        if fast:
            return sampler(logits.clone(), md).sampled_token_ids
        return sampler.sample(logits.clone(), md)

    for _ in range(5):
        assert torch.equal(run(True), run(False))
    if temperature == [0.0, 0.0, 0.0]:
        assert torch.equal(run(True), logits.argmax(dim=-1))
