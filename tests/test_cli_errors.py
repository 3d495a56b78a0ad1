"""Errors that explain at the command line (issue 13): a failure is one line naming the real cause, with no
traceback from this process or the engine process, unless ``--debug``."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys

import pytest

from vllite.logging_utils import TRACEBACKS_ENV, OneLineExceptionFilter, hide_tracebacks_if_requested
from vllite.plugins.commands import main as cli

FAKE_EXECUTOR = "vllite.testing.executors:PositionTokenExecutor"
BROKEN_SCHEDULER = "nonexistent_vllite_policy.mod:Policy"


def _vllite(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != TRACEBACKS_ENV}
    env["VLLITE_ENABLE_MULTIPROCESSING"] = "1"  # as users run it: the engine in its own process
    return subprocess.run(
        [sys.executable, "-m", "vllite.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


def _meaningful_lines(stderr: str) -> list[str]:
    """stderr without progress bars (transformers' weight-loading bar, tqdm)."""
    return [line for line in stderr.splitlines() if line.strip() and "it/s]" not in line and "%|" not in line]


def test_missing_model_folder_is_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    result = _vllite("generate", "--model", str(missing), "hello")
    assert result.returncode in (1, 2)
    lines = _meaningful_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("vllite: error: ") and str(missing) in lines[0]


def test_broken_scheduler_class_path_is_short_and_names_the_cause():
    result = _vllite("generate", "--executor", FAKE_EXECUTOR, "--scheduler-cls", BROKEN_SCHEDULER, "hello")
    assert result.returncode == 1
    lines = _meaningful_lines(result.stderr)
    assert "Traceback" not in result.stderr
    assert len(lines) <= 2, result.stderr
    assert lines[-1].startswith("vllite: error: ") and "nonexistent_vllite_policy" in lines[-1]
    assert "__main__" not in result.stderr  # no inapplicable advice about a main-module guard


@pytest.fixture(scope="module")
def broken_model(tmp_path_factory) -> str:
    """A model folder whose tokenizer and config are fine but whose weights are not: the engine process fails."""
    from vllite.testing import make_tiny_model_dir_cached

    folder = tmp_path_factory.mktemp("broken-model")
    shutil.copytree(make_tiny_model_dir_cached("llama"), folder, dirs_exist_ok=True)
    for weights in folder.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    return str(folder)


def test_engine_process_start_up_failure_is_short_and_names_the_cause(broken_model):
    result = _vllite("generate", "--model", broken_model, "--max-tokens", "2", "hello")
    assert result.returncode == 1
    lines = _meaningful_lines(result.stderr)
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr  # the CLI's error alone: the engine's own record would repeat the cause
    assert lines[-1].startswith("vllite: error: Engine core initialization failed: ")
    assert "SafetensorError" in lines[-1]  # the real cause, carried from the engine process
    assert "__main__" not in result.stderr  # no inapplicable advice about a main-module guard


def test_debug_shows_the_tracebacks_of_both_processes(broken_model):
    result = _vllite("--debug", "generate", "--model", broken_model, "--max-tokens", "2", "hello")
    assert result.returncode == 1
    assert result.stderr.count("Traceback (most recent call last)") >= 2  # the engine's and this process's
    assert "EngineCore failed to start." in result.stderr  # the engine process's record, traceback and all
    assert result.stderr.rstrip().splitlines()[-1].startswith("vllite: error: ")


def test_a_failed_request_is_reported_with_its_cause_and_exit_code_1():
    # A KV cache of one 16-token block cannot hold 2 + 40 tokens: the engine finishes the request with an error.
    result = _vllite(
        "generate", "--executor", FAKE_EXECUTOR, "--num-gpu-blocks-override", "1", "--max-tokens", "40", "hi"
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = _meaningful_lines(result.stderr)
    assert len(lines) <= 2, result.stderr
    assert lines[-1].startswith("vllite: error: request 0 failed: ") and "KV cache" in lines[-1]


class _Boom:
    def run(self, args: argparse.Namespace) -> int:
        raise RuntimeError("something unforeseen")


def _parser_with_failing_command(argv: object = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllite")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("boom").set_defaults(_run=_Boom().run)
    return parser


@pytest.mark.parametrize("debug", [False, True])
def test_an_unexpected_exception_is_one_line_unless_debug(monkeypatch, capsys, debug):
    monkeypatch.setattr(cli, "build_parser", _parser_with_failing_command)
    monkeypatch.delenv(TRACEBACKS_ENV, raising=False)
    assert cli.main(["boom", "--debug"] if debug else ["boom"]) == 1
    err = capsys.readouterr().err
    assert err.rstrip().splitlines()[-1].startswith("vllite: error: RuntimeError: something unforeseen")
    if debug:
        assert "Traceback (most recent call last)" in err
    else:
        assert err.count("\n") == 1 and "--debug" in err
    assert TRACEBACKS_ENV not in os.environ  # main() restores the environment it changed


def test_one_line_exception_filter_replaces_the_traceback(monkeypatch):
    monkeypatch.setenv(TRACEBACKS_ENV, "0")
    records: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = ListHandler()
    hide_tracebacks_if_requested([handler])
    hide_tracebacks_if_requested([handler])
    assert sum(isinstance(f, OneLineExceptionFilter) for f in handler.filters) == 1
    log = logging.getLogger("vllite.test_cli_errors")
    log.addHandler(handler)
    try:
        try:
            raise ValueError("bad value")
        except ValueError:
            log.exception("Start-up failed.")
    finally:
        log.removeHandler(handler)
    assert records == ["Start-up failed: ValueError: bad value"]
