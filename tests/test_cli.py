"""The ``vllite`` command and the light import: ``--version``, ``plugins``, ``generate``, ``chat``, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllite import __version__
from vllite.cli import main
from vllite.testing import make_tiny_model_dir_cached


def test_import_vllite_does_not_import_torch():
    code = "import sys, vllite, vllite.cli, vllite.plugin_manager; print('torch' in sys.modules, 'zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"vllite {__version__}"


def test_plugins_lists_builtins_with_their_components(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["vllite.schedulers.builtin"]["components"]["schedulers"] == ["fcfs", "priority"]
    assert "vllite_register_commands" in rows["vllite.cli_commands"]["hooks"]
    assert "continuum" in rows["vllite.schedulers.continuum_plugin"]["components"]["schedulers"]


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(make_tiny_model_dir_cached("llama"))


def test_generate(tiny_model, capsys):
    assert main(["generate", "--model", tiny_model, "--max-tokens", "5", "--dtype", "float32", "def f(x):"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x):") and len(out.strip()) > len("def f(x):")


def test_chat_scripted(tiny_model, capsys):
    assert main(["chat", "--model", tiny_model, "--max-tokens", "4", "--message", "hi", "--message", "more"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) >= 1


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "hello"]) == 1
    assert "nope" in capsys.readouterr().err


def test_unknown_scheduler_lists_available(tiny_model, capsys):
    code = main(["generate", "--model", tiny_model, "--scheduler-cls", "nonesuch", "--max-tokens", "2", "x"])
    assert code != 0
    err = capsys.readouterr().err
    assert "nonesuch" in err and "fcfs" in err
