"""``vllite serve`` in front of pooling models: ``/v1/embeddings`` through the official ``openai`` client (float and
base64, equal to a Hugging Face forward pass pooled as sentence-transformers pools), ``/pooling``, ``/classify``,
``/score`` and ``/rerank`` in vLLM's shapes (a cross-encoder's scores equal Hugging Face's), the bad inputs that
answer 400 naming the field, and the 400 between generating and pooling routes naming the model's tasks.

Three servers on tiny random-weight models built here (no download): a sentence-transformers folder on a BERT
encoder, a BERT cross-encoder, and the demo (generating) model.
"""

from __future__ import annotations

import asyncio
import base64
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from vllite.plugins.openai_server.testing import RemoteServer  # noqa: E402
from vllite.testing.pooling import make_bert, make_sentence_transformer  # noqa: E402

TEXTS = ["Once upon a time", "def main():", "The quick brown fox jumps over the lazy dog"]
QUERY = "import os"
DOCUMENTS = ["import sys", "The quick brown fox", "def main(): pass", "import os.path"]
MAX_LEN = 64
LABELS = {0: "relevant"}


# ------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling-models")
    embed = make_sentence_transformer(root / "st", seed=1)
    # a cross-encoder (one label) whose label is named, for /classify's ``label``
    cross = make_bert(root / "cross", seed=2, arch="BertForSequenceClassification", num_labels=1, id2label=LABELS)
    return types.SimpleNamespace(embed=embed, cross=cross)


def _serve(folder, name: str):
    return RemoteServer([str(folder), "--served-model-name", name, "--max-model-len", str(MAX_LEN), "--seed", "0"])


@pytest.fixture(scope="module")
def embed_server(folders):
    with _serve(folders.embed, "emb") as remote:
        yield remote


@pytest.fixture(scope="module")
def cross_server(folders):
    with _serve(folders.cross, "cross") as remote:
        yield remote


@pytest.fixture(scope="module")
def gen_server():
    with RemoteServer(["--served-model-name", "demo", "--max-model-len", "128"]) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(embed_server):
    with openai.OpenAI(base_url=embed_server.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(folders):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folders.embed))


@pytest.fixture(scope="module")
def hf_embed(folders, tokenizer):
    """The sentence-transformers reference: BERT's last hidden states, mean-pooled, L2-normalized."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folders.embed)).eval()

    def embed(text: str) -> np.ndarray:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            hidden = model(input_ids=ids).last_hidden_state[0]
        vector = hidden.mean(0)
        return (vector / vector.norm()).numpy()

    return embed


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=60)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_400(response: requests.Response, param: str | None, *words: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


# ------------------------------------------------------------------------------------------------- embeddings


def test_embeddings_float_and_base64_equal_hugging_face(client, hf_embed, tokenizer):
    as_float = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64 and decodes it
    assert as_float.object == "list" and as_float.model == "emb"
    assert [d.index for d in as_float.data] == [0, 1, 2]
    for text, by_float, by_base64 in zip(TEXTS, as_float.data, as_base64.data, strict=True):
        assert by_float.object == "embedding" and len(by_float.embedding) == 64
        assert cosine(by_float.embedding, hf_embed(text)) >= 0.9999
        # Two requests, batched differently: the same vector up to float32 rounding.
        assert np.allclose(np.float32(by_float.embedding), np.float32(by_base64.embedding), atol=1e-6)
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == tokens


def test_base64_is_little_endian_float32(embed_server):
    body = post(embed_server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}).json()
    floats = post(embed_server, "/v1/embeddings", {"input": TEXTS[0]}).json()
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.float32(floats["data"][0]["embedding"]))
    assert body["id"].startswith("embd-") and body["usage"]["completion_tokens"] == 0


def test_token_id_inputs_equal_text_inputs(client, tokenizer):
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    by_text = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    by_ids = client.embeddings.create(model="emb", input=ids, encoding_format="float")
    one = client.embeddings.create(model="emb", input=ids[2], encoding_format="float")
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        assert np.allclose(a.embedding, b.embedding, atol=1e-6)
    assert np.allclose(one.data[0].embedding, by_text.data[2].embedding, atol=1e-6)


def test_many_inputs_in_one_request_keep_their_order(client):
    texts = [f"item number {i} " * (1 + i % 7) for i in range(40)]
    batch = client.embeddings.create(model="emb", input=texts, encoding_format="float")
    assert [d.index for d in batch.data] == list(range(40))
    for i in (0, 13, 39):
        alone = client.embeddings.create(model="emb", input=texts[i], encoding_format="float")
        assert np.allclose(alone.data[0].embedding, batch.data[i].embedding, atol=1e-5)


def test_truncate_prompt_tokens(client, tokenizer):
    long_text = "word " * 200
    assert len(tokenizer(long_text)["input_ids"]) > MAX_LEN
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="emb", input=["short", long_text])
    assert info.value.param == "input" and "input[1]" in info.value.message
    assert "maximum context length" in info.value.message and "truncate_prompt_tokens" in info.value.message
    whole = client.embeddings.create(model="emb", input=long_text, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == MAX_LEN
    cut = client.embeddings.create(model="emb", input=long_text, extra_body={"truncate_prompt_tokens": 8})
    assert cut.usage.prompt_tokens == 8


def test_bad_embedding_requests_answer_400(client, embed_server):
    cases = [
        ({"input": []}, "input", "empty"),
        ({"input": [[1, 2], []]}, "input", "input[1] is empty"),
        ({"input": [1, 2, 10**6]}, "input", "out of the vocabulary"),
        ({"input": [[5], [-1]]}, "input", "out of the vocabulary"),
        ({"input": "hi", "dimensions": 16}, "dimensions", "dimensions"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
        ({"input": "hi", "bogus": 1}, "bogus", "bogus"),
    ]
    for body, param, word in cases:
        assert_400(post(embed_server, "/v1/embeddings", body), param, word)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")
    assert client.embeddings.create(model="emb", input="still serving").data  # each failure failed alone
    # not a Matryoshka model: only its own width is a valid ``dimensions``
    assert (
        len(client.embeddings.create(model="emb", input="hi", dimensions=64, encoding_format="float").data[0].embedding)
        == 64
    )


def test_requests_at_once_all_answer(embed_server):
    bodies = [{"input": [f"text {i}", "other"] if i % 5 else []} for i in range(20)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        codes = list(pool.map(lambda body: post(embed_server, "/v1/embeddings", body).status_code, bodies))
    assert codes == [400 if i % 5 == 0 else 200 for i in range(20)]


# ------------------------------------------------------------------------------------------------- /pooling


def test_pooling_route_default_task_and_token_embed(embed_server, client, tokenizer):
    embedded = client.embeddings.create(model="emb", input=TEXTS[:2], encoding_format="float")
    body = post(embed_server, "/pooling", {"model": "emb", "input": TEXTS[:2]}).json()
    assert body["object"] == "list" and body["id"].startswith("pool-")
    for item, ref in zip(body["data"], embedded.data, strict=True):
        assert item["object"] == "pooling"
        assert np.allclose(item["data"], ref.embedding, atol=1e-6)
    per_token = post(embed_server, "/pooling", {"input": TEXTS[0], "task": "token_embed"}).json()
    rows = per_token["data"][0]["data"]
    assert len(rows) == len(tokenizer(TEXTS[0])["input_ids"]) and len(rows[0]) == 64
    assert_400(post(embed_server, "/pooling", {"input": "x", "task": "classify"}), "model", "classify", "embed")
    assert_400(post(embed_server, "/pooling", {"input": "x", "task": "nope"}), "task")


# ------------------------------------------------------------------------------------------------- score, rerank


def test_score_by_cosine_on_an_embedding_model(embed_server, hf_embed):
    expected = [cosine(hf_embed(QUERY), hf_embed(d)) for d in DOCUMENTS]
    for path in ("/score", "/v1/score"):
        body = post(embed_server, path, {"model": "emb", "text_1": QUERY, "text_2": DOCUMENTS}).json()
        assert body["object"] == "list" and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        assert all(d["object"] == "score" for d in body["data"])
        assert np.allclose([d["score"] for d in body["data"]], expected, atol=1e-4)
    pairwise = post(embed_server, "/score", {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:]}).json()
    assert np.allclose(
        [d["score"] for d in pairwise["data"]],
        [
            cosine(hf_embed(DOCUMENTS[0]), hf_embed(DOCUMENTS[2])),
            cosine(hf_embed(DOCUMENTS[1]), hf_embed(DOCUMENTS[3])),
        ],
        atol=1e-4,
    )


def test_rerank_routes_sort_by_relevance(embed_server, hf_embed):
    expected = [cosine(hf_embed(QUERY), hf_embed(d)) for d in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = post(embed_server, path, {"model": "emb", "query": QUERY, "documents": DOCUMENTS}).json()
        assert body["model"] == "emb" and body["id"].startswith("rerank-")
        assert [r["index"] for r in body["results"]] == order
        for result in body["results"]:
            assert result["document"] == {"text": DOCUMENTS[result["index"]]}
            assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-4)
        assert body["usage"]["total_tokens"] > 0
    top = post(embed_server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False})
    results = top.json()["results"]
    assert [r["index"] for r in results] == order[:2] and all("document" not in r for r in results)
    as_objects = post(embed_server, "/v2/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS]})
    assert [r["index"] for r in as_objects.json()["results"]] == order


def test_bad_score_and_rerank_requests_answer_400(embed_server):
    assert_400(post(embed_server, "/score", {"text_1": "a", "text_2": []}), "text_2", "empty")
    assert_400(post(embed_server, "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), "text_1", "pairwise")
    assert_400(post(embed_server, "/rerank", {"query": "q", "documents": []}), "documents", "empty")
    assert_400(post(embed_server, "/rerank", {"query": "q", "documents": ["a"], "top_n": -1}), "top_n")
    too_long = {"query": "q", "documents": ["ok", "word " * 200]}
    assert_400(post(embed_server, "/rerank", too_long), "documents", "documents[1]", "maximum context length")
    long_query = {"query": "word " * 200, "documents": ["a", "b"]}
    assert_400(post(embed_server, "/v1/rerank", long_query), "query", "query has", "maximum context length")
    assert post(embed_server, "/rerank", {**too_long, "truncate_prompt_tokens": -1}).status_code == 200


# ------------------------------------------------------------------------------------------------- cross-encoder


@pytest.fixture(scope="module")
def hf_cross(folders):
    """Hugging Face's score for a pair, on the ids the engine's ``score_prompt`` gives it: sigmoid of the logit."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from vllite.plugins.pooling.scoring import score_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(folders.cross))
    model = AutoModelForSequenceClassification.from_pretrained(str(folders.cross)).eval()

    def score(text_1: str, text_2: str) -> float:
        prompt = score_prompt(tokenizer, text_1, text_2)
        ids = torch.tensor([prompt["prompt_token_ids"]])
        types_ = prompt.get("token_type_ids")
        kwargs = {"token_type_ids": torch.tensor([types_])} if types_ is not None else {}
        with torch.no_grad():
            return float(torch.sigmoid(model(input_ids=ids, **kwargs).logits[0, 0]))

    return score


def test_cross_encoder_score_and_rerank_equal_hugging_face(cross_server, hf_cross):
    expected = [hf_cross(QUERY, d) for d in DOCUMENTS]
    body = post(cross_server, "/score", {"model": "cross", "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert np.allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
    assert body["usage"]["prompt_tokens"] > 0
    ranked = post(cross_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(4), key=lambda i: -expected[i])[:3]
    assert np.allclose([r["relevance_score"] for r in ranked["results"]], sorted(expected, reverse=True)[:3], atol=1e-5)


def test_classify_shape(cross_server, hf_cross):
    body = post(cross_server, "/classify", {"model": "cross", "input": ["import os", "x = 1"]}).json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    for index, item in enumerate(body["data"]):
        assert item["index"] == index and item["num_classes"] == 1 and item["label"] == "relevant"
        assert len(item["probs"]) == 1 and 0.0 <= item["probs"][0] <= 1.0
    assert body["usage"]["prompt_tokens"] > 0
    # an encoder model answers the embedding routes with 400 naming its tasks
    assert_400(post(cross_server, "/v1/embeddings", {"input": "x"}), "model", "'embed'", "classify")


# ------------------------------------------------------------------------------------------------- routes vs tasks


def test_pooling_routes_on_a_generating_model_answer_400(gen_server):
    bodies = {
        "/v1/embeddings": {"input": "hi"},
        "/pooling": {"input": "hi"},
        "/classify": {"input": "hi"},
        "/score": {"text_1": "a", "text_2": ["b"]},
        "/v1/score": {"text_1": "a", "text_2": ["b"]},
        "/rerank": {"query": "a", "documents": ["b"]},
        "/v2/rerank": {"query": "a", "documents": ["b"]},
    }
    for path, body in bodies.items():
        assert_400(post(gen_server, path, body), "model", "generate", "/v1/completions")
    assert post(gen_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_generating_routes_on_a_pooling_model_answer_400(embed_server):
    user = [{"role": "user", "content": "hi"}]
    bodies = {
        "/v1/completions": {"prompt": "hi"},
        "/v1/chat/completions": {"messages": user},
        "/v1/responses": {"input": "hi"},
    }
    for path, body in bodies.items():
        assert_400(post(embed_server, path, body), "model", "does not generate", "embed", "/v1/embeddings")
    messages = post(embed_server, "/v1/messages", {"model": "emb", "max_tokens": 4, "messages": user})
    assert messages.status_code == 400
    assert "does not generate" in messages.json()["error"]["message"]
    assert post(embed_server, "/v1/embeddings", {"input": "still serving"}).status_code == 200


# ------------------------------------------------------------------------------------------------- concurrency


def test_inputs_are_submitted_concurrently_and_a_failure_aborts_the_rest():
    """``encode_all`` runs every input's ``encode`` at once; when one fails, the others are cancelled (aborted)."""
    from vllite.outputs import PoolingOutput, PoolingRequestOutput
    from vllite.plugins.openai_server.pooling.serving import encode_all
    from vllite.pooling_params import PoolingParams

    class Engine:
        def __init__(self, fail: str | None = None) -> None:
            self.active = self.peak = 0
            self.cancelled: list[str] = []
            self.fail = fail

        async def encode(self, prompt, params, request_id, **_):
            self.active += 1
            self.peak = max(self.peak, self.active)
            try:
                await asyncio.sleep(0.05 if request_id != self.fail else 0.01)
                if request_id == self.fail:
                    raise ValueError("bad input")
                yield PoolingRequestOutput(request_id, PoolingOutput(np.zeros(2)), prompt["prompt_token_ids"])
            except asyncio.CancelledError:
                self.cancelled.append(request_id)
                raise
            finally:
                self.active -= 1

    ctx = types.SimpleNamespace(log_prompt=lambda *a: None)
    prompts = [{"prompt_token_ids": [i + 1]} for i in range(8)]

    ctx.engine = Engine()
    outputs = asyncio.run(encode_all(ctx, "r", prompts, PoolingParams(task="embed")))
    assert [o.request_id for o in outputs] == [f"r-{i}" for i in range(8)] and ctx.engine.peak == 8

    ctx.engine = Engine(fail="r-3")
    with pytest.raises(ValueError, match="bad input"):
        asyncio.run(encode_all(ctx, "r", prompts, PoolingParams(task="embed")))
    assert sorted(ctx.engine.cancelled) == sorted(f"r-{i}" for i in range(8) if i != 3)
