"""Tests for ``vllite.testing`` (tiny random-weight models), the shipped demo model and its training script."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from vllite.assets import DEMO_MODEL_DIR
from vllite.testing import (
    MODEL_PRESETS,
    SUPPORTED_TINY_ARCHS,
    make_model,
    make_tiny_model,
    make_tiny_model_dir_cached,
    tiny_config,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = REPO_ROOT / "scripts" / "train_demo_model.py"
SAMPLE_TEXT = 'def add(a, b):\n    """Return a + b."""\n    return a + b  # ünïcode ✓\n'


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_supported_archs_cover_the_required_families() -> None:
    assert {"llama", "qwen2", "qwen3"} <= set(SUPPORTED_TINY_ARCHS)
    assert len(SUPPORTED_TINY_ARCHS) >= 5


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_tiny_model_builds_loads_and_runs(arch: str) -> None:
    path = make_tiny_model_dir_cached(arch)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (path / name).is_file(), name

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    # The attention interface is how vllite's paged attention enters the model.
    assert model.config._attn_implementation in {"sdpa", "eager"}

    ids = tokenizer(SAMPLE_TEXT, return_tensors="pt")
    assert ids["input_ids"][0, 0].item() == tokenizer.bos_token_id
    assert tokenizer.decode(ids["input_ids"][0], skip_special_tokens=True) == SAMPLE_TEXT
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_tiny_model_is_deterministic_per_seed_and_leaves_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected_next = torch.rand(3)
    torch.manual_seed(1234)
    a = make_tiny_model("qwen3", tmp_path / "a", seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    b = make_tiny_model("qwen3", tmp_path / "b", seed=7)
    c = make_tiny_model("qwen3", tmp_path / "c", seed=8)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


def test_tiny_model_options(tmp_path: Path) -> None:
    path = make_tiny_model(
        "llama",
        tmp_path / "m",
        vocab_size=4160,
        hidden_size=96,
        num_layers=3,
        num_heads=6,
        num_kv_heads=3,
        max_position_embeddings=256,
        dtype="bfloat16",
        intermediate_size=80,
    )
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (4160, 96, 3)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (6, 3, 16)
    assert (config["max_position_embeddings"], config["intermediate_size"]) == (256, 80)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    generation = json.loads((path / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token_id in generation["eos_token_id"]


def test_tiny_model_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown or unavailable arch"):
        make_tiny_model("not-an-arch", tmp_path / "x")
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_tiny_model("llama", tmp_path / "y", vocab_size=100)
    with pytest.raises(ValueError, match="must divide"):
        make_tiny_model("llama", tmp_path / "z", hidden_size=66, num_heads=4)
    with pytest.raises(ValueError, match="dtype"):
        make_tiny_model("llama", tmp_path / "w", dtype="int8")
    with pytest.raises(ValueError, match="unknown preset"):
        make_model(tmp_path / "v", preset="huge")
    with pytest.raises(FileNotFoundError, match="train_demo_model"):
        make_tiny_model("llama", tmp_path / "u", tokenizer_dir=tmp_path / "no-tokenizer-here")


def test_cached_builder_reuses_folders() -> None:
    a = make_tiny_model_dir_cached("llama", seed=5)
    b = make_tiny_model_dir_cached("llama", seed=5)
    c = make_tiny_model_dir_cached("llama", seed=6)
    assert a == b
    assert c != a
    assert _digest(a) != _digest(c)


def test_30m_preset_has_about_30m_parameters() -> None:
    preset = dict(MODEL_PRESETS["30m"])
    intermediate = preset.pop("intermediate_size")
    max_pos = preset.pop("max_position_embeddings")
    config = tiny_config(
        "llama", vocab_size=4096, intermediate_size=intermediate, max_position_embeddings=max_pos, **preset
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    assert 25e6 <= n_params <= 35e6, n_params


# --- the shipped demo model -------------------------------------------------------------------------------------


def test_demo_model_folder_is_complete_and_small() -> None:
    names = {p.name for p in DEMO_MODEL_DIR.iterdir()}
    required = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    assert required <= names, f"missing: {required - names}"
    total = sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir() if p.is_file())
    assert total < 10 * 1024 * 1024, total
    config = AutoConfig.from_pretrained(DEMO_MODEL_DIR)
    assert config.model_type == "llama"
    assert json.loads((DEMO_MODEL_DIR / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_demo_tokenizer_round_trips_and_has_chat_template() -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    ids = tokenizer(SAMPLE_TEXT)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == SAMPLE_TEXT
    assert len(ids) < len(SAMPLE_TEXT) / 2  # BPE merges, not bytes
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.model_max_length == 1024
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a function."}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|endoftext|><|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n"


def test_demo_model_greedy_generates_python() -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR)
    enc = tokenizer("def fibonacci(n):", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    new_tokens = out[0, enc["input_ids"].shape[1] :]
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert len(new_tokens) == 24 and text.strip()
    # A function body: the next line is indented.
    assert text.startswith("\n    ") or text.startswith("\n\t"), repr(text)


# --- the training script (tiny settings, so it runs in seconds) ----------------------------------------------


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> Path:
    root = tmp_path / "stdlib"
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    for i in range(6):
        (root / f"mod{i}.py").write_text(SAMPLE_TEXT * 8 + f"\n\nclass C{i}:\n    def m(self):\n        return {i}\n")
    (root / "pkg" / "__init__.py").write_text("import os\n\n" + SAMPLE_TEXT * 4)
    (root / "test" / "test_x.py").write_text("SHOULD_NOT_BE_READ = 1\n")
    return root


def test_train_script_tokenizer_only(tiny_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "tok"
    cmd = [sys.executable, str(TRAIN_SCRIPT), "--tokenizer-only", "--stdlib", str(tiny_corpus)]
    cmd += ["--out", str(out), "--vocab-size", "300"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert 260 <= len(tokenizer) <= 300
    assert "SHOULD_NOT_BE_READ" not in tokenizer.get_vocab()
    assert tokenizer.decode(tokenizer(SAMPLE_TEXT)["input_ids"], skip_special_tokens=True) == SAMPLE_TEXT
    assert not (out / "model.safetensors").exists()
    # The script writes the chat template the shipped demo model carries.
    shipped = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == shipped


@pytest.mark.slow
def test_train_script_end_to_end_tiny(tiny_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    cmd = [sys.executable, str(TRAIN_SCRIPT), "--stdlib", str(tiny_corpus), "--out", str(out)]
    cmd += ["--vocab-size", "300", "--hidden-size", "32", "--intermediate-size", "64", "--num-layers", "1"]
    cmd += ["--seq-len", "32", "--batch-size", "2", "--steps", "3", "--warmup-steps", "1", "--eval-every", "2"]
    cmd += ["--sample-tokens", "4", "--holdout-fraction", "0.2"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["args"]["steps"] == 3
    assert [h["step"] for h in summary["history"]] == [0, 1, 2]
    assert "val_loss" in summary["history"][-1]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert model.config.tie_word_embeddings
    assert model.config.num_key_value_heads == 2
