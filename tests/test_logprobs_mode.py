"""``logprobs_mode`` (vLLM's ``--logprobs-mode``): what sampled-token logprobs hold. ``raw_logprobs`` (default) and
``raw_logits`` come from the model's logits before any processing; ``processed_logprobs`` and ``processed_logits``
from the values actually sampled from (penalties, temperature, top-k applied, excluded tokens at -inf). Prompt
logprobs are raw logprobs in every mode. Each mode is checked against values computed here from a Hugging Face
forward pass of the same tiny model, offline (``LLM``), in the sampler itself and over HTTP (``vllite serve``);
a bad mode is refused naming the field and the allowed values."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vllite import LLM, SamplingParams
from vllite.config import LOGPROBS_MODES
from vllite.plugins.transformers_executor.sampler import Sampler, SamplingMetadata

PROMPTS = [[5, 9, 30, 31, 32, 5, 9, 30, 31], [100, 7, 7, 64, 12]]
MAX_TOKENS = 5
NUM_LOGPROBS = 3
TOP_K, TEMPERATURE, REPETITION_PENALTY = 4, 0.7, 1.6


def hf_logits(tiny_llama_hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), vocab]``: the model's logits at each generated position (teacher-forced)."""
    with torch.no_grad():
        return tiny_llama_hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The greedy request's processed logits: the repetition penalty on every token seen before each position."""
    rows = []
    for i, row in enumerate(logits):
        seen = torch.zeros_like(row, dtype=torch.bool)
        seen[prompt + output[:i]] = True
        penalty = torch.where(seen, REPETITION_PENALTY, 1.0)
        rows.append(torch.where(row > 0, row / penalty, row * penalty))
    return torch.stack(rows)


def tempered_top_k(logits: torch.Tensor) -> torch.Tensor:
    """The random request's processed logits: divided by its temperature, all but its top-k at -inf."""
    scaled = logits / TEMPERATURE
    kth = scaled.topk(TOP_K, dim=-1).values[:, -1:]
    return scaled.masked_fill(scaled < kth, float("-inf"))


def expected(mode: str, raw: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
    values = raw if mode.startswith("raw") else processed
    return values if mode.endswith("_logits") else torch.log_softmax(values, dim=-1)


def check(positions, token_ids: list[int], reference: torch.Tensor) -> None:
    """Every returned entry (the sampled token and the top-N) equals the reference; the top-N are its best."""
    assert len(positions) == len(token_ids) == reference.shape[0]
    for position, token, row in zip(positions, token_ids, reference):
        assert token in position
        for token_id, entry in position.items():
            assert entry.logprob == pytest.approx(row[token_id].item(), abs=2e-4), (token_id, entry)
        best = set(row.topk(NUM_LOGPROBS).indices.tolist())
        assert best <= set(position)


# ------------------------------------------------------------------------------------------------ offline
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_generate_returns_the_values_of_each_mode(tiny_llama_dir, tiny_llama_hf, mode):
    greedy = SamplingParams(
        temperature=0.0,
        repetition_penalty=REPETITION_PENALTY,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        logprobs=NUM_LOGPROBS,
        prompt_logprobs=2,
    )
    random = SamplingParams(
        temperature=TEMPERATURE, top_k=TOP_K, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS
    )
    with LLM(tiny_llama_dir, dtype="float32", block_size=16, max_model_len=128, logprobs_mode=mode) as llm:
        first, second = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [greedy, random], use_tqdm=False)
    out = first.outputs[0]
    raw = hf_logits(tiny_llama_hf, PROMPTS[0], out.token_ids)
    check(out.logprobs, out.token_ids, expected(mode, raw, penalized(raw, PROMPTS[0], out.token_ids)))
    out = second.outputs[0]
    raw = hf_logits(tiny_llama_hf, PROMPTS[1], out.token_ids)
    check(out.logprobs, out.token_ids, expected(mode, raw, tempered_top_k(raw)))
    # Prompt logprobs are raw logprobs whatever the mode (vLLM computes them from the model's logits).
    with torch.no_grad():
        prompt_reference = torch.log_softmax(tiny_llama_hf(torch.tensor([PROMPTS[0]])).logits[0, :-1].float(), dim=-1)
    assert first.prompt_logprobs[0] is None
    for position, token, row in zip(first.prompt_logprobs[1:], PROMPTS[0][1:], prompt_reference):
        assert position[token].logprob == pytest.approx(row[token].item(), abs=2e-4)


def test_bad_mode_is_refused_naming_the_field_and_the_choices(tiny_llama_dir):
    with pytest.raises(ValueError, match="logprobs_mode") as info:
        LLM(tiny_llama_dir, logprobs_mode="processed")
    assert all(mode in str(info.value) for mode in LOGPROBS_MODES)
    with pytest.raises(ValueError, match="logprobs_mode=processed_logits cannot be combined with speculative"):
        LLM(tiny_llama_dir, logprobs_mode="processed_logits", speculative_config={"method": "ngram"})


# ------------------------------------------------------------------------------------------------ sampler
def test_sampler_processed_values_are_what_it_sampled_from():
    """A mixed batch: a greedy row gets its logits as processed, a random row its tempered, top-k / top-p masked
    ones; the raw modes return the input untouched by the masking."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.3, 2.5, 2.0, -0.5, 1.0]])
    md = SamplingMetadata(
        temperature=torch.tensor([0.0, 0.5]),
        all_greedy=False,
        all_random=False,
        top_p=torch.tensor([1.0, 0.9]),
        top_k=torch.tensor([5, 3]),
        generators={},
        default_generator=torch.Generator().manual_seed(0),
        max_num_logprobs=5,
    )
    processed_random = torch.tensor([0.3, 2.5, 2.0, -0.5, 1.0]) / 0.5
    processed_random[[0, 3]] = float("-inf")  # outside the top 3
    tail = torch.softmax(processed_random, dim=-1)
    assert tail[4] < 0.1  # and the top-p mass 0.9 is reached without token 4
    processed_random[4] = float("-inf")
    processed = torch.stack([logits[0], processed_random])
    for mode in LOGPROBS_MODES:
        out = Sampler(mode)(logits.clone(), md)
        assert out.logprobs_tensors is not None
        values = expected(mode, logits, processed)
        ids, got = out.logprobs_tensors.logprob_token_ids, out.logprobs_tensors.logprobs
        assert torch.allclose(got, values.gather(1, ids), atol=1e-6), mode
    assert out.sampled_token_ids[0].item() == 0


# ------------------------------------------------------------------------------------------------ server
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    from vllite.plugins.openai_server.testing import RemoteServer

    args = [tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "128", "--dtype", "float32"]
    with (
        RemoteServer([*args, "--logprobs-mode", "processed_logprobs"]) as server,
        openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c,
    ):
        yield c


def test_serve_returns_processed_logprobs(client, tiny_llama_hf):
    response = client.completions.create(
        model="tiny",
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE,
        seed=3,
        logprobs=TOP_K + 2,
        extra_body={"top_k": TOP_K, "ignore_eos": True, "return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    token_ids = choice.model_extra["token_ids"]
    reference = torch.log_softmax(tempered_top_k(hf_logits(tiny_llama_hf, PROMPTS[1], token_ids)), dim=-1)
    for top, token, row in zip(choice.logprobs.top_logprobs, token_ids, reference):
        assert f"token_id:{token}" in top
        values = {int(key.split(":")[1]): value for key, value in top.items()}
        finite = {t: v for t, v in values.items() if v > -9999.0}
        assert len(finite) == TOP_K  # the tokens top-k excluded come back at -inf, written -9999.0 as in vLLM
        for token_id, value in finite.items():
            assert value == pytest.approx(row[token_id].item(), abs=2e-4)


def test_serve_refuses_a_bad_mode_naming_the_choices(tiny_llama_dir):
    result = subprocess.run(
        [sys.executable, "-m", "vllite.cli", "serve", tiny_llama_dir, "--logprobs-mode", "raw"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "--logprobs-mode" in result.stderr and all(mode in result.stderr for mode in LOGPROBS_MODES)
