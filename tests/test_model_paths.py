"""Paths and names a user types (issue 28, item 2): ``--chat-template`` files, model folders, two models at once.

Each case runs ``vllite`` (or ``LLM``) in a subprocess, as users do, and fails before any engine starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from vllite.assets import default_model_path
from vllite.logging_utils import TRACEBACKS_ENV

FAKE_EXECUTOR = "vllite.testing.executors:PositionTokenExecutor"


def _run(args: list[str], cwd: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != TRACEBACKS_ENV}
    env["VLLITE_ENABLE_MULTIPROCESSING"] = "1"  # as users run it: the engine in its own process
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def _vllite(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "vllite.cli", *args], cwd=cwd)


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed start-up prints (asserts there is exactly one)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("vllite: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_a_chat_template_path_that_cannot_be_opened_is_an_error_naming_it(tmp_path, command):
    extra = ["--message", "hi"] if command == "chat" else ["--port", "0"]
    result = _vllite(command, "--chat-template", "./missing.jinja", "--executor", FAKE_EXECUTOR, *extra, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    line = _error_line(result)
    assert "'./missing.jinja'" in line and "--chat-template" in line


def test_a_chat_template_text_and_a_file_still_work(tmp_path):
    from vllite.engine.tokenizer import load_chat_template

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert load_chat_template(template) == template
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == template


@pytest.fixture(scope="module")
def model_without_template(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("no-template")
    shutil.copytree(default_model_path(), folder, dirs_exist_ok=True)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    return str(folder)


def test_the_no_chat_template_error_names_the_flag(model_without_template):
    code = textwrap.dedent(
        f"""
        from vllite import LLM
        llm = LLM({model_without_template!r}, executor={FAKE_EXECUTOR!r})
        try:
            llm.chat([{{"role": "user", "content": "hi"}}])
        except ValueError as exc:
            print(exc)
        finally:
            llm.shutdown()
        """
    )
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert "no chat template" in result.stdout and "--chat-template" in result.stdout, result.stdout


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_model_that_is_not_a_folder_is_named_missing(tmp_path, command):
    extra = ["hi"] if command == "generate" else ["--port", "0"]
    result = _vllite(command, "--model", "./no-such-model", *extra, cwd=tmp_path)
    assert result.returncode in (1, 2)
    line = _error_line(result)
    assert "'./no-such-model'" in line and "does not exist" in line and "Hugging Face Hub id" in line
    assert "Tokenizer" not in line and "tokenizer" not in line


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_hub_id_that_is_not_cached_offline_is_named(tmp_path, command, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no download: the id is looked up in an empty cache
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    extra = ["hi"] if command == "generate" else ["--port", "0"]
    result = _vllite(command, "--model", "Qwen/Qwen2.5-0.5B-Instruct", *extra, cwd=tmp_path)
    assert result.returncode == 1
    line = _error_line(result)
    assert "'Qwen/Qwen2.5-0.5B-Instruct'" in line and "HF_HUB_OFFLINE=1" in line and "cache" in line
    assert "Tokenizer" not in line and "tokenizer" not in line


def test_the_parent_folder_of_a_model_has_no_config_json(tmp_path):
    shutil.copytree(default_model_path(), tmp_path / "models" / "demo")
    parent = str(tmp_path / "models")
    result = _vllite("generate", "--model", parent, "hi")
    assert result.returncode in (1, 2)
    line = _error_line(result)
    assert f"no config.json in {parent!r}" in line.lower()
    assert "--tokenizer" not in line


def test_serve_with_a_model_and_another_model_flag_names_both(tmp_path):
    result = _vllite("serve", "model-a", "--model", "model-b", "--port", "0", cwd=tmp_path)
    assert result.returncode == 2
    line = _error_line(result)
    assert "'model-a'" in line and "'model-b'" in line
