"""``prompt_embeds`` inputs (``--enable-prompt-embeds``) offline, through ``LLM`` and its engine-core subprocess (the
embeddings cross the msgspec wire as raw buffers): greedy tokens equal the token-id prompt's and Hugging Face
``generate(inputs_embeds=...)``'s, in batches mixing embeds and token prompts, under chunked prefill, prefix caching
(blocks are never shared by placeholder ids) and preemption; bad tensors are rejected with a ``ValueError`` naming
the problem and the engine keeps serving."""

from __future__ import annotations

import pytest
import torch

from vllite import LLM, SamplingParams

TEXTS = [
    "def add(a, b):",
    "import os\nimport sys\nimport json\nimport time\n",
    "class Point:\n    def __init__(self, x, y):",
    "# compute the mean of a list of numbers and print it",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # A small token budget (chunked prefill of every prompt here), small blocks (prefix caching over short prompts)
    # and a small KV cache (preemption with a few concurrent requests).
    engine = LLM(
        tiny_llama_dir,
        dtype="float32",
        enable_prompt_embeds=True,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        block_size=4,
        num_gpu_blocks_override=24,
        disable_log_stats=False,
    )
    yield engine
    engine.shutdown()


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(llm, text: str) -> list[int]:
    return list(llm.get_tokenizer().encode(text))


@torch.inference_mode()
def embed(tiny_llama_hf, ids: list[int]) -> torch.Tensor:
    return tiny_llama_hf.get_input_embeddings()(torch.tensor(ids)).clone()


@torch.inference_mode()
def hf_greedy(tiny_llama_hf, embeds: torch.Tensor, max_tokens: int = MAX_TOKENS) -> list[int]:
    mask = torch.ones(1, len(embeds), dtype=torch.long)
    out = tiny_llama_hf.generate(
        inputs_embeds=embeds[None], attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, min_length=0
    )
    return out[0].tolist()


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_embeds_prompt_equals_token_prompt_and_hf(llm, tiny_llama_hf):
    for text in TEXTS:
        ids = token_ids(llm, text)
        embeds = embed(tiny_llama_hf, ids)
        by_embeds = llm.generate({"prompt_embeds": embeds}, greedy(), use_tqdm=False)[0]
        by_ids = llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)[0]
        assert (
            list(by_embeds.outputs[0].token_ids)
            == list(by_ids.outputs[0].token_ids)
            == hf_greedy(tiny_llama_hf, embeds)
        )
        assert by_embeds.prompt_token_ids == [0] * len(ids)  # vLLM's placeholder ids, one per row
        assert by_embeds.outputs[0].text == by_ids.outputs[0].text


def test_embeds_that_no_token_has_match_hf(llm, tiny_llama_hf):
    # Embeddings off the vocabulary's rows (what prompt embeds are for), bfloat16 and with a batch dimension of one.
    generator = torch.Generator().manual_seed(0)
    embeds = embed(tiny_llama_hf, token_ids(llm, TEXTS[1])) + 0.05 * torch.randn(
        len(token_ids(llm, TEXTS[1])), tiny_llama_hf.config.hidden_size, generator=generator
    )
    out = llm.generate({"prompt_embeds": embeds[None]}, greedy(), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(tiny_llama_hf, embeds)
    half = embeds.to(torch.bfloat16)
    out = llm.generate({"prompt_embeds": half}, greedy(), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(tiny_llama_hf, half.float())


def test_batch_mixing_embeds_and_token_prompts(llm, tiny_llama_hf):
    ids = [token_ids(llm, t) for t in TEXTS]
    alone = [list(llm.generate({"prompt_token_ids": i}, greedy(), use_tqdm=False)[0].outputs[0].token_ids) for i in ids]
    prompts = [
        {"prompt_embeds": embed(tiny_llama_hf, ids[0])},
        {"prompt_token_ids": ids[1]},
        {"prompt_embeds": embed(tiny_llama_hf, ids[2])},
        TEXTS[3],
    ]
    assert tokens(llm.generate(prompts, greedy(), use_tqdm=False)) == alone


def test_prefix_cache_keys_on_the_embeddings(llm, tiny_llama_hf):
    # Two different embeds prompts of the same length have the same placeholder ids: sharing blocks by token id
    # would hand the second the first one's KV.
    ids = token_ids(llm, TEXTS[1])
    first = embed(tiny_llama_hf, ids)
    other = embed(tiny_llama_hf, list(reversed(ids)))
    assert len(ids) >= 8  # at least two full blocks of 4
    assert hf_greedy(tiny_llama_hf, first) != hf_greedy(tiny_llama_hf, other)  # a shared block would show
    llm.generate({"prompt_embeds": first}, greedy(), use_tqdm=False)
    out = llm.generate({"prompt_embeds": other}, greedy(), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert list(out.outputs[0].token_ids) == hf_greedy(tiny_llama_hf, other)
    # The same embeddings again do hit the cache, and give the same tokens.
    again = llm.generate({"prompt_embeds": first}, greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens >= 4
    assert list(again.outputs[0].token_ids) == hf_greedy(tiny_llama_hf, first)


def test_one_token_prompt_step_takes_the_embedding_row(llm, tiny_llama_hf):
    # A prompt of one block and one token, the block cached: its last position is computed alone, a one-token step
    # that looks like a decode step; it must take the embedding row, not the placeholder id (nor the compiled decode
    # step, which only takes token ids).
    embeds = embed(tiny_llama_hf, token_ids(llm, TEXTS[2])[:5])
    expected = hf_greedy(tiny_llama_hf, embeds)
    assert list(llm.generate({"prompt_embeds": embeds}, greedy(), use_tqdm=False)[0].outputs[0].token_ids) == expected
    again = llm.generate({"prompt_embeds": embeds}, greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens == 4
    assert list(again.outputs[0].token_ids) == expected


def test_preemption_recomputes_from_the_embeddings(llm, tiny_llama_hf):
    # 24 blocks of 4 tokens; four requests of up to 14 + 40 tokens cannot all stay: some are preempted and
    # recompute their prompt from the embeddings kept on the request.
    embeds = [embed(tiny_llama_hf, token_ids(llm, t)) for t in TEXTS]
    outputs = llm.generate([{"prompt_embeds": e} for e in embeds], greedy(40), use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert tokens(outputs) == [hf_greedy(tiny_llama_hf, e, 40) for e in embeds]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda h: torch.zeros(5, h + 1), "does not match the model's hidden size"),
        (lambda h: torch.zeros(h), "must be 2-D"),
        (lambda h: torch.zeros(2, 3, h), "must be 2-D"),
        (lambda h: torch.zeros(5, h, dtype=torch.int64), "floating-point dtype"),
        (lambda h: torch.zeros(0, h), "is empty"),
        (lambda h: torch.zeros(65, h), "more than max_model_len"),
        (lambda h: [[0.0] * h], "must be a dense torch.Tensor"),
    ],
)
def test_bad_embeds_rejected_and_engine_serves_on(llm, tiny_llama_hf, make, message):
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt_embeds": make(tiny_llama_hf.config.hidden_size)}, greedy(), use_tqdm=False)
    ids = token_ids(llm, TEXTS[0])
    assert len(llm.generate({"prompt_token_ids": ids}, greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_prompt_logprobs_with_embeds_rejected(llm, tiny_llama_hf):
    embeds = embed(tiny_llama_hf, token_ids(llm, TEXTS[0]))
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    with pytest.raises(ValueError, match="prompt_logprobs cannot be computed for a prompt_embeds prompt"):
        llm.generate({"prompt_embeds": embeds}, params, use_tqdm=False)


def test_engine_rejects_bad_embeds_frame_for_that_request_only(llm, tiny_llama_hf):
    """The engine does not trust the frontend: a request whose embeddings have the wrong width, sent straight to the
    engine core, ends with an ERROR output naming the problem, and the next request runs."""
    from vllite.protocol import EngineCoreRequest

    engine = llm.llm_engine
    bad = EngineCoreRequest(
        request_id="bad-embeds",
        prompt_token_ids=None,
        sampling_params=greedy(2),
        eos_token_id=None,
        arrival_time=0.0,
        prompt_embeds=torch.zeros(3, tiny_llama_hf.config.hidden_size + 2),
    )
    engine.output_processor.add_request(bad, None)
    engine.engine_core.add_request(bad)
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
    assert len(finished) == 1 and finished[0].outputs[0].finish_reason == "error"
    assert "hidden size" in (finished[0].outputs[0].error or "")
    ids = token_ids(llm, TEXTS[0])
    assert len(llm.generate({"prompt_token_ids": ids}, greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_not_enabled_is_a_clear_value_error(tiny_llama_dir):
    from vllite.config import ModelConfig
    from vllite.engine.input_processor import InputProcessor
    from vllite.protocol import EngineInfo

    info = EngineInfo(max_model_len=64, num_gpu_blocks=8, block_size=4, max_num_batched_tokens=64, vocab_size=100)
    processor = InputProcessor(ModelConfig(model=tiny_llama_dir), info, None, {})
    with pytest.raises(ValueError, match=r"enable_prompt_embeds=True \(--enable-prompt-embeds\)"):
        processor.process_inputs("r", {"prompt_embeds": torch.zeros(2, 8)}, SamplingParams())
