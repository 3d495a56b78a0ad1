"""What the frontend gives users: generation-config defaults, request metrics, chat templates, CLI sampling flags."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllite import LLM, SamplingParams
from vllite.cli import build_parser, main
from vllite.testing import make_tiny_model_dir_cached

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def model_with_generation_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "llama"
    shutil.copytree(make_tiny_model_dir_cached("llama"), path)
    generation = (
        json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").exists() else {}
    )
    generation.update(temperature=0.5, top_p=0.8, top_k=7, repetition_penalty=1.1)
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.fixture(scope="module")
def llm(model_with_generation_config):
    llm = LLM(str(model_with_generation_config), dtype="float32", disable_log_stats=False)
    yield llm
    llm.shutdown()


def test_default_sampling_params_come_from_generation_config(llm, model_with_generation_config):
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.5, 0.8, 7, 1.1)
    plain = LLM(str(model_with_generation_config), dtype="float32", generation_config="vllm")
    try:
        assert plain.get_default_sampling_params().temperature == SamplingParams().temperature
    finally:
        plain.shutdown()


def test_cli_flags_override_the_models_defaults_and_the_cli_defaults_apply_last(llm):
    from vllite.plugins.commands.plugin import _sampling_params

    parser = build_parser()
    args = parser.parse_args(["generate", "x"])
    params = _sampling_params(args, llm)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.5, 7, 64)
    args = parser.parse_args(["generate", "--temperature", "0", "--max-tokens", "3", "x"])
    params = _sampling_params(args, llm)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 7, 3)


def test_list_flags_do_not_swallow_the_prompt():
    args = build_parser().parse_args(["generate", "--logits-processors", "a.b:C,d.e:F", "the prompt"])
    assert args.prompts == ["the prompt"] and args.logits_processors == ["a.b:C", "d.e:F"]


@pytest.mark.parametrize("multiprocess", [False, True])
def test_metrics_are_filled_when_stats_are_on(model_with_generation_config, monkeypatch, multiprocess):
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1" if multiprocess else "0")
    llm = LLM(str(model_with_generation_config), dtype="float32", disable_log_stats=False)
    try:
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    metrics = out.metrics
    assert metrics is not None and metrics.num_generation_tokens == 4
    assert metrics.arrival_time > 0 and metrics.queued_ts is not None and metrics.scheduled_ts is not None
    assert metrics.time_in_queue is not None and metrics.time_in_queue >= 0
    assert metrics.first_token_time is not None and metrics.last_token_time >= metrics.first_token_time


def test_no_metrics_when_stats_are_off(model_with_generation_config):
    llm = LLM(str(model_with_generation_config), dtype="float32")
    try:
        (out,) = llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.metrics is None


def test_chat_template_argument_overrides_the_tokenizers(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=TEMPLATE)
    assert tokenizer.decode(out.prompt_token_ids) == "[user] hello\n[assistant]"


def test_cli_chat_template_from_a_file(model_with_generation_config, tmp_path, capsys):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    argv = ["chat", "--model", str(model_with_generation_config), "--dtype", "float32", "--max-tokens", "2"]
    assert main([*argv, "--chat-template", str(template), "--message", "hi"]) == 0
    assert capsys.readouterr().out.strip() != ""
