"""Sentence-transformers folders in both pooling-config formats: the one current sentence-transformers writes
(``1_Pooling/config.json`` with ``"pooling_mode": "mean"``) and the older ``pooling_mode_*_tokens`` booleans. Each
supported mode equals ``SentenceTransformer.encode``; a mode vllite cannot pool the same way is refused at load,
naming the file and the value, instead of being pooled some other way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vllite import LLM
from vllite.exceptions import ModelLoadError
from vllite.plugins.transformers_executor.pooling.setup import resolve_pooling_setup
from vllite.testing.pooling import make_bert

TEXTS = ["hello world", "def add(a, b):\n    return a + b", "import os\nprint(os.getcwd())\n" * 6, "x"]


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_bert(tmp_path_factory.mktemp("bert") / "model", seed=5)
    # A BERT tokenizer has no chat template (the demo tokenizer does): with one, sentence-transformers >= 6 saves a
    # "message" modality and encodes each text as a chat turn, which is not what is compared here.
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return folder


def _save_with_sentence_transformers(bert: Path, folder: Path, mode: str) -> Path:
    """The folder the installed sentence-transformers writes for ``Transformer → Pooling(mode) → Normalize``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(bert))
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode=mode)
    SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu").save(str(folder))
    return folder


def _pooling_config(folder: Path) -> dict:
    return json.loads((folder / "1_Pooling" / "config.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("mode", ["mean", "cls", "lasttoken"])
def test_a_folder_saved_by_sentence_transformers_equals_its_encode(
    bert_folder: Path, tmp_path: Path, mode: str
) -> None:
    from sentence_transformers import SentenceTransformer

    folder = _save_with_sentence_transformers(bert_folder, tmp_path / mode, mode)
    config = _pooling_config(folder)
    assert config.get("pooling_mode") == mode or config.get(f"pooling_mode_{mode}_tokens") is True, config
    reference = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(str(folder), max_model_len=512)
    try:
        outputs = llm.embed(TEXTS, use_tqdm=False)
    finally:
        llm.shutdown()
    cosines = [F.cosine_similarity(torch.tensor(o.outputs.embedding), r.float(), dim=0).item() for o, r in
               zip(outputs, reference)]  # fmt: skip
    assert min(cosines) > 0.9999, cosines


def _write_pooling_config(bert: Path, folder: Path, config: dict) -> Path:
    """A sentence-transformers folder written by hand with the pooling module's ``config``."""
    folder.mkdir(parents=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules), encoding="utf-8")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def _legacy(mode_key: str) -> dict:
    keys = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    return {"word_embedding_dimension": 64, **{f"pooling_mode_{k}": k == mode_key for k in keys}}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"embedding_dimension": 64, "pooling_mode": "mean", "include_prompt": True}, "MEAN"),
        ({"embedding_dimension": 64, "pooling_mode": "cls"}, "CLS"),
        ({"embedding_dimension": 64, "pooling_mode": "lasttoken"}, "LAST"),
        ({"embedding_dimension": 64, "pooling_mode": ["cls"]}, "CLS"),
        ({"embedding_dimension": 64, "pooling_mode": "cls", "include_prompt": False}, "CLS"),  # no prompts here
        ({"embedding_dimension": 64}, "MEAN"),  # sentence-transformers' default mode
        (_legacy("mean_tokens"), "MEAN"),
        (_legacy("cls_token"), "CLS"),
        (_legacy("lasttoken"), "LAST"),
        (_legacy("none"), "MEAN"),  # no boolean set: sentence-transformers pools the mean
    ],
)
def test_both_pooling_config_formats_are_read(bert_folder: Path, tmp_path: Path, config: dict, expected: str) -> None:
    folder = _write_pooling_config(bert_folder, tmp_path / "st", config)
    assert resolve_pooling_setup(str(folder), None, "auto", None).pooling_type == expected


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"embedding_dimension": 64, "pooling_mode": "median"}, "'median'"),
        ({"embedding_dimension": 64, "pooling_mode": "max"}, "'max'"),
        ({"embedding_dimension": 64, "pooling_mode": "weightedmean"}, "'weightedmean'"),
        ({"embedding_dimension": 64, "pooling_mode": ["cls", "mean"]}, "['cls', 'mean']"),
        ({"embedding_dimension": 64, "pooling_mode": 3}, "3"),
        (_legacy("max_tokens"), "pooling_mode_max_tokens"),
        ({**_legacy("cls_token"), "pooling_mode_mean_tokens": True}, "pooling_mode_mean_tokens"),
    ],
)
def test_a_pooling_config_vllite_does_not_understand_is_refused(
    bert_folder: Path, tmp_path: Path, config: dict, named: str
) -> None:
    folder = _write_pooling_config(bert_folder, tmp_path / "st", config)
    with pytest.raises(ModelLoadError) as info:
        resolve_pooling_setup(str(folder), None, "auto", None)
    message = str(info.value)
    assert str(folder / "1_Pooling" / "config.json") in message and named in message, message


def test_a_sentence_transformers_module_vllite_does_not_run_is_refused(bert_folder: Path, tmp_path: Path) -> None:
    folder = _write_pooling_config(bert_folder, tmp_path / "st", {"pooling_mode": "mean"})
    modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    modules.append({"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (folder / "modules.json").write_text(json.dumps(modules), encoding="utf-8")
    with pytest.raises(ModelLoadError, match=r"modules\.json.*LayerNorm"):
        resolve_pooling_setup(str(folder), None, "auto", None)


def test_a_max_pooled_folder_saved_by_sentence_transformers_is_refused_by_llm(
    bert_folder: Path, tmp_path: Path
) -> None:
    folder = _save_with_sentence_transformers(bert_folder, tmp_path / "max", "max")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
        with pytest.raises(ModelLoadError, match=r"1_Pooling.*'max'"):
            LLM(str(folder), max_model_len=512)
