"""Random-weight pooling models for tests and benchmarks: a BERT encoder, a sentence-transformers folder on it, a
BERT cross-encoder, and decoder classification models. Built locally (no download) with the demo tokenizer; the
same arguments give the same weights. Each builder returns the model folder. BERT sizes default to a tiny model
(:data:`BERT_SIZES`); ``config`` overrides them, e.g. MiniLM-L6's ``hidden_size=384, num_hidden_layers=6,
num_attention_heads=12, intermediate_size=1536`` for benchmarks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllite.testing.models import copy_demo_tokenizer, make_tiny_model

__all__ = ["BERT_SIZES", "make_bert", "make_cross_encoder", "make_decoder_classifier", "make_sentence_transformer"]

_ST_MODE_KEYS = {
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "lasttoken": "pooling_mode_lasttoken",
}
BERT_SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


def _vocab_size(folder: Path) -> int:
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1


def _pad_on_the_right(folder: Path) -> None:
    """BERT's tokenizers pad on the right: its absolute positions start at the first real token then."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    config["padding_side"] = "right"
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")


def _save(model: Any, folder: Path) -> Path:
    model.eval().save_pretrained(folder)
    return folder


def make_bert(folder: str | Path, *, seed: int = 0, arch: str = "BertModel", **config: Any) -> Path:
    """A BERT-style encoder (``BertModel``, or ``BertForSequenceClassification`` with ``num_labels``)."""
    import torch
    import transformers

    folder = copy_demo_tokenizer(folder)
    _pad_on_the_right(folder)
    bert_config = transformers.BertConfig(
        vocab_size=_vocab_size(folder), max_position_embeddings=512, type_vocab_size=2, **{**BERT_SIZES, **config}
    )
    bert_config.architectures = [arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, arch)(bert_config)
    return _save(model, folder)


def make_sentence_transformer(
    folder: str | Path, *, seed: int = 0, pooling: str = "mean", normalize: bool = True, **config: Any
) -> Path:
    """A sentence-transformers folder on a BERT (:func:`make_bert`): ``modules.json``, the pooling module's config
    (``mean``, ``cls`` or ``lasttoken``) and, with ``normalize``, a Normalize module."""
    folder = make_bert(folder, seed=seed, **config)
    hidden_size = config.get("hidden_size", BERT_SIZES["hidden_size"])
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules, indent=2), encoding="utf-8")
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    pooling_dir = folder / "1_Pooling"
    pooling_dir.mkdir(exist_ok=True)
    modes = {f"pooling_mode_{m}": False for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    modes[_ST_MODE_KEYS[pooling]] = True
    pooling_config = {"word_embedding_dimension": hidden_size, **modes}
    (pooling_dir / "config.json").write_text(json.dumps(pooling_config, indent=2), encoding="utf-8")
    if normalize:
        (folder / "2_Normalize").mkdir(exist_ok=True)
    return folder


def make_cross_encoder(folder: str | Path, *, seed: int = 0) -> Path:
    """A BERT cross-encoder: ``BertForSequenceClassification`` with one label (a relevance score)."""
    return make_bert(folder, seed=seed, arch="BertForSequenceClassification", num_labels=1)


def make_decoder_classifier(folder: str | Path, *, arch: str = "qwen3", seed: int = 0, num_labels: int = 3) -> Path:
    """A decoder ``*ForSequenceClassification`` model (Qwen3 by default): the tiny causal LM's config and
    tokenizer, with a classification head of ``num_labels``."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    folder = make_tiny_model(arch, folder, seed=seed)
    config = AutoConfig.from_pretrained(folder)
    config.num_labels = num_labels
    config.id2label = {i: f"label_{i}" for i in range(num_labels)}
    config.label2id = {v: k for k, v in config.id2label.items()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
    for stale in folder.glob("*.safetensors"):
        stale.unlink()
    return _save(model, folder)
