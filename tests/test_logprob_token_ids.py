"""``logprob_token_ids`` (vLLM's field): at every generated position the engine returns the logprobs of exactly the
token ids a request names (with the sampled token's), equal to a Hugging Face forward pass, offline through
``LLM.generate`` (with and without speculative decoding, beside requests asking for a top-N) and over HTTP with the
official ``openai`` client; every misuse is a ``ValueError`` / HTTP 400 naming the field."""

from __future__ import annotations

import pytest
import torch

from tests.test_server_request_fields import post
from vllite import LLM, SamplingParams
from vllite.plugins.transformers_executor.sampler import gather_logprobs
from vllite.sampling_params import MAX_LOGPROB_TOKEN_IDS

LABELS = [7, 42, 3, 250]
PROMPTS = [[5, 9, 30, 31, 32, 5, 9, 30, 31], [100, 7, 7, 64, 12]]
MAX_TOKENS = 6


def hf_step_logprobs(tiny_llama_hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), vocab]``: the model's log_softmax at each generated position (teacher-forced)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = tiny_llama_hf(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def check_positions(positions, token_ids: list[int], reference: torch.Tensor, labels: list[int]) -> None:
    """Each position holds the sampled token (with its true rank) and exactly ``labels`` (no rank), all equal
    to the reference."""
    assert len(positions) == len(token_ids) == reference.shape[0]
    for position, token, row in zip(positions, token_ids, reference):
        assert set(position) == {token, *labels}
        for token_id, entry in position.items():
            assert entry.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        assert position[token].rank == int((row > row[token]).sum()) + 1
        assert all(position[t].rank is None for t in labels if t != token)


# ------------------------------------------------------------------------------------------------ validation
def test_logprobs_defaults_to_the_number_of_ids():
    params = SamplingParams(logprob_token_ids=(4, 2))
    assert params.logprobs == 2 and params.logprob_token_ids == [4, 2]
    assert SamplingParams(logprobs=2, logprob_token_ids=[4, 2]).logprobs == 2
    assert params.clone().logprob_token_ids is not params.logprob_token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logprobs": 3, "logprob_token_ids": [1, 2]}, "logprobs must equal len"),
        ({"logprob_token_ids": [1, 1]}, "distinct"),
        ({"logprob_token_ids": [-1]}, "integers >= 0"),
        ({"logprob_token_ids": []}, "1 to"),
        ({"logprob_token_ids": list(range(MAX_LOGPROB_TOKEN_IDS + 1))}, f"1 to {MAX_LOGPROB_TOKEN_IDS}"),
    ],
)
def test_bad_logprob_token_ids_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match="logprob") as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


# ------------------------------------------------------------------------------------------------ sampler
def test_gather_puts_each_rows_own_ids_after_the_sampled_token():
    logprobs = torch.log_softmax(torch.tensor([[3.0, 1.0, 2.0, 0.0, 0.5], [0.0, 0.0, 5.0, 1.0, 2.0]]), dim=-1)
    t = gather_logprobs(logprobs, 3, torch.tensor([2, 0]), {1: [4, 1]})
    assert t.logprob_token_ids[0].tolist() == [2, 0, 2, 1]  # top-3 row unchanged
    assert t.logprob_token_ids[1, :3].tolist() == [0, 4, 1]
    assert torch.allclose(t.logprobs[1, :3], logprobs[1, [0, 4, 1]])
    assert t.selected_token_ranks.tolist() == [2, 5]


# ------------------------------------------------------------------------------------------------ offline
def _generate(tiny_llama_dir: str, params: list[SamplingParams], **llm_kwargs):
    with LLM(tiny_llama_dir, dtype="float32", block_size=16, max_model_len=128, **llm_kwargs) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram-drafts"])
def test_generate_returns_the_named_ids_equal_to_hugging_face(tiny_llama_dir, tiny_llama_hf, speculative):
    labels = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprob_token_ids=LABELS)
    top = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=6)
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}} if speculative else {}
    first, second = _generate(tiny_llama_dir, [labels, top], **spec)
    sample = first.outputs[0]
    check_positions(
        sample.logprobs, sample.token_ids, hf_step_logprobs(tiny_llama_hf, PROMPTS[0], sample.token_ids), LABELS
    )
    # The other request in the same batch keeps its own top-6.
    reference = hf_step_logprobs(tiny_llama_hf, PROMPTS[1], second.outputs[0].token_ids)
    for position, row in zip(second.outputs[0].logprobs, reference):
        top_ids = set(torch.topk(row, 6).indices.tolist())
        assert top_ids <= set(position) and len(position) <= 7


def test_out_of_vocabulary_id_is_refused_naming_the_field(tiny_llama_dir):
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=64) as llm:
        vocab = llm.llm_engine.engine_info.vocab_size
        with pytest.raises(ValueError, match="logprob_token_ids"):
            llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(logprob_token_ids=[1, vocab]), use_tqdm=False)
        # Not bounded by max_logprobs (20 by default), as in vLLM: only by MAX_LOGPROB_TOKEN_IDS.
        out = llm.generate(
            {"prompt_token_ids": [1, 2]},
            SamplingParams(max_tokens=1, logprob_token_ids=list(range(30))),
            use_tqdm=False,
        )
        assert set(range(30)) <= set(out[0].outputs[0].logprobs[0])


# ------------------------------------------------------------------------------------------------ server
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from vllite.plugins.openai_server.testing import RemoteServer

    with RemoteServer(
        [tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "128", "--dtype", "float32"]
    ) as r:
        yield r


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


def test_completions_top_logprobs_are_the_named_ids(client, tiny_llama_hf):
    response = client.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=4,
        temperature=0,
        logprobs=1,  # vLLM: must be set; the named ids replace its top-N
        extra_body={"logprob_token_ids": LABELS, "return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    token_ids = choice.model_extra["token_ids"]
    reference = hf_step_logprobs(tiny_llama_hf, PROMPTS[0], token_ids)
    for top, token, row in zip(choice.logprobs.top_logprobs, token_ids, reference):
        assert set(top) == {f"token_id:{t}" for t in [token, *LABELS]}
        for key, value in top.items():
            assert value == pytest.approx(row[int(key.split(":")[1])].item(), abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_are_the_named_ids_in_order(client, tiny_llama_hf, stream):
    kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    extra = {"logprob_token_ids": LABELS, "return_tokens_as_token_ids": True}
    if stream:
        chunks = client.chat.completions.create(**kwargs, logprobs=True, stream=True, extra_body=extra)
        content = [
            item
            for chunk in chunks
            if chunk.choices and chunk.choices[0].logprobs
            for item in chunk.choices[0].logprobs.content
        ]
    else:
        response = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2, extra_body=extra)
        content = response.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert [t.token for t in item.top_logprobs] == [f"token_id:{t}" for t in LABELS]
        assert all(t.logprob <= 0 for t in item.top_logprobs)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": "hi", "logprob_token_ids": [1]}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 1, "logprob_token_ids": [1, 1]}, "distinct"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 1, "logprob_token_ids": [10**6]}, "vocabulary"),
        (
            "/v1/completions",
            {"prompt": "hi", "logprobs": 1, "echo": True, "max_tokens": 0, "logprob_token_ids": [1]},
            "max_tokens=0",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "logprobs": 1, "use_beam_search": True, "n": 2, "logprob_token_ids": [1]},
            "beam search",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprob_token_ids": [1]},
            "logprobs",
        ),
    ],
)
def test_misuse_is_400_naming_logprob_token_ids(server, path, body, message):
    status, payload = post(server, path, {"model": "tiny", **body})
    assert status == 400, payload
    assert payload["error"]["param"] == "logprob_token_ids"
    assert message in payload["error"]["message"]
