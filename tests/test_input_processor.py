"""Tokenizer loading and InputProcessor: prompt forms, validation, parameter defaults, request ids."""

from __future__ import annotations

import json
import re

import pytest
from tokenizer_support import build_tiny_tokenizer

from vllite.config import ModelConfig
from vllite.engine.frontend import engine_request_id
from vllite.engine.input_processor import InputProcessor, extract_prompt_text
from vllite.engine.tokenizer import apply_chat_template, get_tokenizer
from vllite.exceptions import ModelLoadError
from vllite.model_files import load_generation_config
from vllite.protocol import EngineCoreRequest, EngineInfo
from vllite.sampling_params import SamplingParams

CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "héllo wörld 日本語"] * 3
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(CORPUS, chat_template=TEMPLATE, save_dir=path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return get_tokenizer(tokenizer_dir)


def make_processor(tokenizer, max_model_len=32, model=None, vocab_size=None, eos_token_ids=(), **kw):
    info = EngineInfo(
        max_model_len=max_model_len,
        num_gpu_blocks=64,
        block_size=16,
        max_num_batched_tokens=2048,
        vocab_size=vocab_size or (len(tokenizer) if tokenizer is not None else 300),
        eos_token_ids=eos_token_ids,
    )
    return InputProcessor(ModelConfig(model=str(model) if model else None), info, tokenizer, **kw)


# ---------------------------------------------------------------------------- tokenizer loading
def test_get_tokenizer_loads_local_folder(tokenizer):
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
    ids = tokenizer.encode("hello 日本")
    assert tokenizer.decode(ids) == "hello 日本"


def test_get_tokenizer_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        get_tokenizer(tmp_path / "nope")


def test_get_tokenizer_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"No tokenizer files.*tokenizer\.json"):
        get_tokenizer(tmp_path)


def test_get_tokenizer_broken_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="Could not load the tokenizer"):
        get_tokenizer(tmp_path)


def test_load_generation_config(tokenizer_dir, tmp_path):
    assert load_generation_config(tokenizer_dir) == {"eos_token_id": [2, 7]}
    assert load_generation_config(tmp_path) == {} and load_generation_config(None) == {}
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        load_generation_config(tmp_path)


def test_chat_template(tokenizer):
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "hello"}])
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids).endswith("user: hello\nassistant:")
    no_prompt = apply_chat_template(tokenizer, [{"role": "user", "content": "hello"}], add_generation_prompt=False)
    assert not tokenizer.decode(no_prompt).endswith("assistant:")


def test_chat_template_missing():
    tok = build_tiny_tokenizer(CORPUS)
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        apply_chat_template(None, [{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------- prompt forms
def test_text_and_dict_prompts(tokenizer):
    proc = make_processor(tokenizer)
    expected = tokenizer.encode("hello world")
    for prompt in ("hello world", {"prompt": "hello world"}, {"prompt_token_ids": expected}, expected):
        req = proc.process_inputs("r", prompt, SamplingParams(max_tokens=4), arrival_time=1.5)
        assert isinstance(req, EngineCoreRequest)
        assert req.prompt_token_ids == expected
        assert req.arrival_time == 1.5 and req.eos_token_id == 2 and req.request_id == "r"


def test_prompt_text_extraction():
    assert extract_prompt_text("a") == "a"
    assert extract_prompt_text({"prompt": "b"}) == "b"
    assert extract_prompt_text({"prompt_token_ids": [1]}) is None
    assert extract_prompt_text([1, 2]) is None


def test_cache_salt_priority_and_arrival(tokenizer, monkeypatch):
    proc = make_processor(tokenizer)
    req = proc.process_inputs("r", {"prompt_token_ids": [3, 4], "cache_salt": "abc"}, SamplingParams(), priority=-2)
    assert req.cache_salt == "abc" and req.priority == -2
    req = proc.process_inputs("r", {"prompt_token_ids": [3], "cache_salt": "abc"}, SamplingParams(), cache_salt="x")
    assert req.cache_salt == "x"
    monkeypatch.setattr("time.time", lambda: 1234.0)
    assert proc.process_inputs("r", [3], SamplingParams()).arrival_time == 1234.0


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ("", ValueError, "empty"),
        ({"prompt_token_ids": []}, ValueError, "empty"),
        ([], ValueError, "empty"),
        ([1, 300], ValueError, r"Token id 300 .*out of vocabulary.*\[0, 300\)"),
        ([-1, 5], ValueError, "Token id -1"),
        ([1, 2.0], ValueError, "list of integers"),
        ([1, True], ValueError, "list of integers"),
        ({"prompt_token_ids": "abc"}, ValueError, "list of integers"),
        ({"text": "x"}, ValueError, "Unknown prompt keys"),
        ({}, ValueError, "needs 'prompt'"),
        (42, TypeError, "A prompt must be"),
        (b"bytes", TypeError, "A prompt must be"),
    ],
)
def test_invalid_prompts(tokenizer, prompt, error, match):
    with pytest.raises(error, match=match):
        make_processor(tokenizer).process_inputs("r", prompt, SamplingParams())


def test_prompt_too_long_names_both_numbers(tokenizer):
    proc = make_processor(tokenizer, max_model_len=8)
    proc.process_inputs("r", list(range(3, 11)), SamplingParams())  # exactly max_model_len is allowed
    with pytest.raises(ValueError, match=r"9 tokens long.*maximum model length of 8"):
        proc.process_inputs("r", list(range(3, 12)), SamplingParams())


def test_truncate_prompt_tokens(tokenizer):
    proc = make_processor(tokenizer, max_model_len=8)
    req = proc.process_inputs("r", list(range(3, 15)), SamplingParams(truncate_prompt_tokens=4))
    assert req.prompt_token_ids == [11, 12, 13, 14]
    req = proc.process_inputs("r", list(range(3, 15)), SamplingParams(truncate_prompt_tokens=-1))
    assert req.prompt_token_ids == list(range(7, 15))


def test_bad_argument_types(tokenizer):
    proc = make_processor(tokenizer)
    with pytest.raises(TypeError, match="request_id must be a string"):
        proc.process_inputs(1, [3], SamplingParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        proc.process_inputs("r", [3], {"temperature": 0})
    with pytest.raises(TypeError, match="priority"):
        proc.process_inputs("r", [3], SamplingParams(), priority="high")


def test_params_token_ids_checked_against_vocab(tokenizer):
    proc = make_processor(tokenizer)
    with pytest.raises(ValueError, match=r"allowed_token_ids.*\[300\]"):
        proc.process_inputs("r", [3], SamplingParams(allowed_token_ids=[1, 300]))
    with pytest.raises(ValueError, match=r"logit_bias.*\[999\]"):
        proc.process_inputs("r", [3], SamplingParams(logit_bias={999: 1.0}))


def test_without_tokenizer_only_token_ids():
    proc = make_processor(None, generation_config={"eos_token_id": 5})
    req = proc.process_inputs("r", [1, 2, 3], SamplingParams())
    assert req.eos_token_id == 5 and req.prompt_token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="need a tokenizer"):
        proc.process_inputs("r", "text", SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        proc.process_inputs("r", [1], SamplingParams(stop=["x"]))


def test_the_engines_vocab_size_bounds_token_ids(tokenizer):
    proc = make_processor(tokenizer, vocab_size=512)  # the model's vocabulary, larger than the tokenizer's
    assert proc.process_inputs("r", [400], SamplingParams()).prompt_token_ids == [400]
    with pytest.raises(ValueError, match="512"):
        proc.process_inputs("r", [512], SamplingParams())


def test_eos_falls_back_to_what_the_engine_reports():
    proc = make_processor(None, eos_token_ids=(11, 12))
    assert proc.process_inputs("r", [1], SamplingParams()).eos_token_id == 11


# ---------------------------------------------------------------------------- params
def test_params_are_cloned_and_defaults_filled(tokenizer, tokenizer_dir):
    proc = make_processor(tokenizer, max_model_len=20, model=tokenizer_dir)
    params = SamplingParams(max_tokens=None, stop_token_ids=[9])
    req = proc.process_inputs("r", [3, 4, 5], params)
    assert req.sampling_params is not params
    assert req.sampling_params.max_tokens == 17
    assert params.max_tokens is None
    # generation_config eos ids other than the primary one become stop tokens
    assert req.sampling_params.all_stop_token_ids == [9, 7]
    assert params.all_stop_token_ids == [9]


def test_max_tokens_default_is_at_least_one(tokenizer):
    proc = make_processor(tokenizer, max_model_len=3)
    assert proc.process_inputs("r", [3, 4, 5], SamplingParams(max_tokens=None)).sampling_params.max_tokens == 1


def test_explicit_max_tokens_kept(tokenizer):
    proc = make_processor(tokenizer, max_model_len=10)
    assert proc.process_inputs("r", [3, 4], SamplingParams(max_tokens=50)).sampling_params.max_tokens == 50


def test_ignore_eos_skips_generation_config(tokenizer, tokenizer_dir):
    proc = make_processor(tokenizer, model=tokenizer_dir)
    req = proc.process_inputs("r", [3], SamplingParams(ignore_eos=True))
    assert req.sampling_params.all_stop_token_ids == []


def test_processor_chat_template(tokenizer):
    ids = make_processor(tokenizer).apply_chat_template([{"role": "user", "content": "the fox"}])
    assert tokenizer.decode(ids).endswith("assistant:")


# ---------------------------------------------------------------------------- request ids
def test_engine_request_ids_are_unique_per_request(monkeypatch):
    monkeypatch.delenv("VLLITE_DISABLE_REQUEST_ID_RANDOMIZATION", raising=False)
    a, b = engine_request_id("0"), engine_request_id("0")
    assert re.fullmatch(r"0-[0-9a-f]{8}", a) and a != b


def test_engine_request_id_without_randomization(monkeypatch):
    monkeypatch.setenv("VLLITE_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert engine_request_id("7") == "7"
