"""Beam search (vLLM's frontend loop over the engine): ``LLM.beam_search`` and ``use_beam_search`` on the server
equal a reference beam search, Hugging Face ``generate(num_beams=..., do_sample=False, length_penalty=...,
early_stopping=...)``, on a tiny model: every returned sequence's token ids, in order.

HF knobs set on purpose: ``num_return_sequences=num_beams`` (to compare every beam, not only the best one),
``pad_token_id`` (HF pads shorter finished sequences with it; the padding is stripped before comparing) and an
all-ones ``attention_mask`` (otherwise HF masks prompt tokens equal to the pad token, which chat prompts contain).
The model's ``generation_config.json`` lists a few frequent tokens as extra EOS ids, for both sides alike: a random
tiny model almost never samples its real EOS, and without finished sequences neither ``early_stopping`` nor the length
penalty of finished sequences would be exercised.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from vllite import LLM
from vllite.sampling_params import BeamSearchParams
from vllite.testing import make_tiny_model

openai = pytest.importorskip("openai")

# Tokens this model (seed 1) generates often; as EOS ids they end many beams early.
EXTRA_EOS = [3852, 2355, 1324, 2990]
PAD = 2
MAX_TOKENS = 12
CASES = [  # (beam width, length_penalty, early_stopping)
    (3, 1.0, False),
    (2, 0.0, "never"),
    (4, 2.0, True),
    (3, -0.5, False),
    (3, 1.0, "never"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("beam") / "llama", seed=1)
    config_path = Path(path) / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [*config["eos_token_id"], *EXTRA_EOS]
    config_path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, 3000) for _ in range(rng.randint(3, 12))] for _ in range(6)]


def hf_beams(hf_model, prompt: list[int], width: int, length_penalty: float, early_stopping) -> list[list[int]]:
    """HF's beams for ``prompt``, best first, generated tokens only, padding stripped."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            pad_token_id=PAD,
        )
    beams = []
    for row in out.tolist():
        generated = row[len(prompt) :]
        while generated and generated[-1] == PAD:
            generated.pop()
        beams.append(generated)
    return beams


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, dtype="float32", max_model_len=256) as engine:
        yield engine


@pytest.mark.parametrize(("width", "length_penalty", "early_stopping"), CASES)
def test_llm_beam_search_equals_hugging_face(llm, hf_model, prompts, width, length_penalty, early_stopping):
    params = BeamSearchParams(
        beam_width=width, max_tokens=MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    finished_early = 0
    for prompt, output in zip(prompts, outputs):
        ours = [sequence.tokens[len(prompt) :] for sequence in output.sequences]
        assert ours == hf_beams(hf_model, prompt, width, length_penalty, early_stopping), prompt
        for sequence in output.sequences:
            assert sequence.tokens[: len(prompt)] == prompt
            assert len(sequence.logprobs) == len(sequence.tokens) - len(prompt)
            assert sequence.cum_logprob == pytest.approx(
                sum(position[t].logprob for position, t in zip(sequence.logprobs, sequence.tokens[len(prompt) :]))
            )
            assert sequence.text == llm.get_tokenizer().decode(sequence.tokens)
            finished_early += sequence.finish_reason == "stop"
            if sequence.finish_reason == "stop":
                assert sequence.stop_reason == sequence.tokens[-1]
    if width == 3 and early_stopping is False and length_penalty < 0:
        assert finished_early  # the extra EOS ids do end beams in this case


def test_ignore_eos_runs_every_beam_to_max_tokens(llm, prompts):
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True, length_penalty=-0.5)
    for output in llm.beam_search([{"prompt_token_ids": p} for p in prompts], params):
        assert [s.finish_reason for s in output.sequences] == ["length", "length"]
        assert all(len(s.logprobs) == 6 for s in output.sequences)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "early_stopping": "sometimes"}, "early_stopping"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
    ],
)
def test_bad_beam_search_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


# ------------------------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def client(model_dir):
    from vllite.plugins.openai_server.testing import RemoteServer

    args = [model_dir, "--served-model-name", "tiny", "--max-model-len", "256", "--dtype", "float32"]
    with RemoteServer(args) as remote, openai.OpenAI(base_url=remote.base_url, api_key="unused", max_retries=0) as c:
        yield c


def test_completions_use_beam_search_equals_hugging_face(client, hf_model, prompts):
    width, length_penalty, early_stopping = 3, -0.5, False
    response = client.completions.create(
        model="tiny",
        prompt=prompts[:3],
        n=width,
        max_tokens=MAX_TOKENS,
        extra_body={
            "use_beam_search": True,
            "length_penalty": length_penalty,
            "early_stopping": early_stopping,
            "return_token_ids": True,
        },
    )
    assert [c.index for c in response.choices] == list(range(3 * width))
    for i, prompt in enumerate(prompts[:3]):
        expected = hf_beams(hf_model, prompt, width, length_penalty, early_stopping)
        choices = response.choices[i * width : (i + 1) * width]
        assert [c.model_extra["token_ids"] for c in choices] == expected
        for choice in choices:
            assert choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in response.choices)


def test_chat_use_beam_search_equals_hugging_face(client, hf_model):
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Beam me up"}],
        n=2,
        max_completion_tokens=8,
        extra_body={"use_beam_search": True, "length_penalty": 0.0, "return_token_ids": True},
    )
    prompt = response.model_extra["prompt_token_ids"]
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=2,
            num_return_sequences=2,
            do_sample=False,
            max_new_tokens=8,
            length_penalty=0.0,
            pad_token_id=PAD,
        )
    expected = [[t for t in row[len(prompt) :]] for row in out.tolist()]
    for choice, hf in zip(response.choices, expected):
        ours = choice.model_extra["token_ids"]
        assert hf[: len(ours)] == ours and all(t == PAD for t in hf[len(ours) :])
    assert [c.index for c in response.choices] == [0, 1]


def test_beam_search_with_stream_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny", prompt="x", n=2, max_tokens=2, stream=True, extra_body={"use_beam_search": True}
        )
    assert info.value.body["param"] == "stream"


def test_too_wide_a_beam_is_400_naming_n(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", n=16, max_tokens=2, extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "n"
