"""Pooling models end to end through ``LLM``: each result against its oracle (sentence-transformers, or a Hugging
Face forward pass pooled the same way), in-process and in the engine-core process, with chunked prefill and many
requests at once; and every bad input a clear ``ValueError`` while the engine serves on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllite import LLM, PoolingParams, SamplingParams
from vllite.testing import make_tiny_model
from vllite.testing.pooling import make_cross_encoder, make_decoder_classifier, make_sentence_transformer

TEXTS = [
    "hello world",
    "def add(a, b):\n    return a + b",
    "import os\nprint(os.getcwd())\n" * 12,  # long: several KV blocks
    "x",
]


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_sentence_transformer(tmp_path_factory.mktemp("st") / "model"))


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen") / "model", seed=3))


@pytest.fixture(scope="module")
def st_llm(st_folder: str):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(st_folder, max_model_len=512)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def qwen_embed_llm(qwen_folder: str):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(qwen_folder, runner="pooling", convert="embed", max_model_len=512, max_num_batched_tokens=64)
    yield llm
    llm.shutdown()


def _cosines(ours: list[list[float]], reference: torch.Tensor) -> list[float]:
    return [F.cosine_similarity(torch.tensor(a), b.float(), dim=0).item() for a, b in zip(ours, reference)]


def test_sentence_transformers_folder_equals_its_encode(st_llm: LLM, st_folder: str) -> None:
    from sentence_transformers import SentenceTransformer

    assert st_llm.supported_tasks == ("embed", "token_embed")
    outputs = st_llm.embed(TEXTS, use_tqdm=False)
    reference = SentenceTransformer(st_folder, device="cpu").encode(TEXTS, convert_to_tensor=True)
    assert min(_cosines([o.outputs.embedding for o in outputs], reference)) >= 0.9999
    norms = [torch.tensor(o.outputs.embedding).norm().item() for o in outputs]
    assert norms == pytest.approx([1.0] * len(TEXTS), abs=1e-5)  # the folder's Normalize module


def test_decoder_embedding_is_the_normalized_last_hidden_state_under_chunked_prefill(
    qwen_embed_llm: LLM, qwen_folder: str
) -> None:
    from transformers import AutoModel

    tokenizer = qwen_embed_llm.get_tokenizer()
    model = AutoModel.from_pretrained(qwen_folder).eval()
    outputs = qwen_embed_llm.embed(TEXTS, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outputs) > 64  # ran in chunks of the 64-token budget
    for text, output in zip(TEXTS, outputs):
        ids = tokenizer.encode(text)
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
        assert F.cosine_similarity(torch.tensor(output.outputs.embedding), last, dim=0).item() >= 0.9999
        assert torch.tensor(output.outputs.embedding).norm().item() == pytest.approx(1.0, abs=1e-5)


def test_token_embed_and_unnormalized_embeddings(qwen_embed_llm: LLM, qwen_folder: str) -> None:
    from transformers import AutoModel

    ids = qwen_embed_llm.get_tokenizer().encode(TEXTS[2])
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(qwen_folder).eval()(torch.tensor([ids])).last_hidden_state[0]
    [per_token] = qwen_embed_llm.encode([TEXTS[2]], pooling_task="token_embed", use_tqdm=False)
    assert per_token.outputs.data.shape == hidden.shape
    assert torch.allclose(per_token.outputs.data, F.normalize(hidden, dim=-1), atol=1e-4)
    [raw] = qwen_embed_llm.embed([TEXTS[2]], pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    assert torch.allclose(torch.tensor(raw.outputs.embedding), hidden[-1], atol=1e-4)


def test_many_requests_at_once_each_equal_alone(qwen_embed_llm: LLM) -> None:
    prompts = [f"item {i}: " + "word " * (i % 37) for i in range(512)]
    together = qwen_embed_llm.embed(prompts, use_tqdm=False)
    assert [o.request_id for o in together] == sorted((o.request_id for o in together), key=int)
    for i in (0, 5, 36, 511):
        [alone] = qwen_embed_llm.embed([prompts[i]], use_tqdm=False)
        assert together[i].outputs.embedding == pytest.approx(alone.outputs.embedding, abs=1e-5)


def test_sequence_classifier_equals_hugging_face_softmax(tmp_path) -> None:
    from transformers import AutoModelForSequenceClassification

    folder = make_decoder_classifier(tmp_path / "cls", num_labels=3)
    llm = LLM(str(folder), max_model_len=256)
    try:
        assert llm.supported_tasks == ("classify", "score", "token_classify")
        outputs = llm.classify(TEXTS, use_tqdm=False)
        model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        tokenizer = llm.get_tokenizer()
        for text, output in zip(TEXTS, outputs):
            with torch.no_grad():
                logits = model(torch.tensor([tokenizer.encode(text)])).logits[0]
            assert output.outputs.probs == pytest.approx(torch.softmax(logits, -1).tolist(), abs=1e-5)
        [raw] = llm.classify([TEXTS[0]], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        assert sum(raw.outputs.probs) != pytest.approx(1.0)  # logits, not probabilities
    finally:
        llm.shutdown()


def test_cross_encoder_scores_equal_hugging_face(tmp_path) -> None:
    from transformers import AutoModelForSequenceClassification

    folder = make_cross_encoder(tmp_path / "ce")
    llm = LLM(str(folder), max_model_len=512)
    try:
        query, documents = "how to add numbers", TEXTS
        scores = llm.score(query, documents, use_tqdm=False)
        model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        tokenizer = llm.get_tokenizer()
        for document, output in zip(documents, scores):
            encoded = tokenizer(query, document, return_tensors="pt")
            with torch.no_grad():
                logit = model(**encoded).logits[0, 0]
            assert output.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
        # BERT's segment ids: the second text's tokens are type 1 (given as a token prompt here).
        ids = tokenizer.encode(query) + tokenizer.encode(documents[1])
        types = [0] * len(tokenizer.encode(query)) + [1] * (len(ids) - len(tokenizer.encode(query)))
        [typed] = llm.encode([{"prompt_token_ids": ids, "token_type_ids": types}], pooling_task="score", use_tqdm=False)
        with torch.no_grad():
            logit = model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0, 0]
        assert typed.outputs.data.item() == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
    finally:
        llm.shutdown()


def test_embedding_model_scores_by_cosine(st_llm: LLM) -> None:
    scores = st_llm.score(TEXTS[0], TEXTS[:2], use_tqdm=False)
    embeddings = [torch.tensor(o.outputs.embedding) for o in st_llm.embed(TEXTS[:2], use_tqdm=False)]
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    assert scores[1].outputs.score == pytest.approx(
        F.cosine_similarity(embeddings[0], embeddings[1], dim=0).item(), abs=1e-5
    )


def test_engine_core_process_equals_in_process(st_folder: str, st_llm: LLM) -> None:
    with LLM(st_folder, max_model_len=512) as llm:  # the engine-core process: the tensor crosses the wire
        remote = llm.embed(TEXTS, use_tqdm=False)
    local = st_llm.embed(TEXTS, use_tqdm=False)
    for a, b in zip(remote, local):
        assert a.outputs.embedding == pytest.approx(b.outputs.embedding, abs=1e-6)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda llm: llm.embed([], use_tqdm=False), "No prompts"),
        (lambda llm: llm.embed([{"prompt_token_ids": [1, 10**6]}], use_tqdm=False), "out of vocabulary"),
        (lambda llm: llm.embed(["word " * 600], use_tqdm=False), "longer than the maximum model length"),
        (lambda llm: llm.embed(["hi"], pooling_params=PoolingParams(dimensions=8), use_tqdm=False), "dimensions"),
        (lambda llm: llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False), "supports: embed"),
        (lambda llm: llm.classify(["hi"], use_tqdm=False), "does not support the pooling task 'classify'"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_engine_serves_on(st_llm: LLM, call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(st_llm)
    assert len(st_llm.embed(["still serving"], use_tqdm=False)[0].outputs.embedding) == 64


def test_truncation_keeps_the_last_tokens(st_llm: LLM) -> None:
    long_text = "word " * 600
    [output] = st_llm.embed([long_text], truncate_prompt_tokens=100, use_tqdm=False)
    assert output.prompt_token_ids == st_llm.get_tokenizer().encode(long_text)[-100:]


def test_pooling_on_a_generating_model_and_logits_processors_on_a_pooling_model_are_refused(qwen_folder: str) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
        generator = LLM(qwen_folder, max_model_len=128)
        try:
            with pytest.raises(ValueError, match="does not support the pooling task 'embed'; it supports: generate"):
                generator.embed(["hi"], use_tqdm=False)
        finally:
            generator.shutdown()
        with pytest.raises(ValueError, match="take no --logits-processors"):
            LLM(
                qwen_folder,
                runner="pooling",
                logits_processors=["vllite.testing.logitsprocs:ForcedSequenceLogitsProcessor"],
            )


def test_reward_with_step_pooling_returns_the_tagged_positions(tmp_path) -> None:
    from transformers import AutoModelForSequenceClassification

    folder = make_decoder_classifier(tmp_path / "prm", num_labels=3)
    ids = [11, 12, 99, 13, 14, 99, 15]
    pooler_config = {"pooling_type": "STEP", "step_tag_id": 99, "returned_token_ids": [0, 2]}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(str(folder), max_model_len=128, pooler_config=pooler_config)
    try:
        [reward] = llm.reward([{"prompt_token_ids": ids}], use_tqdm=False)
        model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        with torch.no_grad():
            per_token = torch.softmax(model.score(model.model(torch.tensor([ids])).last_hidden_state[0]), -1)
        assert torch.allclose(reward.outputs.data, per_token[[2, 5]][:, [0, 2]], atol=1e-5)
    finally:
        llm.shutdown()


def test_the_memory_profile_forward_runs_every_kind_of_model(st_llm: LLM, qwen_embed_llm: LLM, tmp_path) -> None:
    """On CUDA the KV cache is sized after a dummy forward (``profile_run``) measures peak activations. A pooling
    model has no logits to sort: its runner profiles its base and its head. Nothing else calls this on the CPU, so it
    is called here directly, and the engines serve on unchanged after it."""
    classifier = LLM(str(make_decoder_classifier(tmp_path / "cls", num_labels=3)), max_model_len=256)
    cross_encoder = LLM(str(make_cross_encoder(tmp_path / "ce")), max_model_len=256)
    generator = LLM(str(make_tiny_model("llama", tmp_path / "gen", seed=1)), max_model_len=256)
    try:
        for llm in (st_llm, qwen_embed_llm, classifier, cross_encoder, generator):
            runner = llm.llm_engine.engine_core.engine_core.model_executor.runner  # in-process
            caches = runner.kv_caches
            runner.profile_run(64)
            assert runner.kv_caches is caches  # the dummy forward's own small cache is gone again
        before = st_llm.embed(TEXTS[:2], use_tqdm=False)
        assert [o.outputs.embedding for o in st_llm.embed(TEXTS[:2], use_tqdm=False)] == [
            o.outputs.embedding for o in before
        ]
        assert len(classifier.classify(TEXTS[:1], use_tqdm=False)[0].outputs.probs) == 3
        out = generator.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        for llm in (classifier, cross_encoder, generator):
            llm.shutdown()
