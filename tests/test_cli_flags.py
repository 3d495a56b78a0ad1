"""Flags a vLLM user types (issue 28, item 3): vLLM flags vllite lacks are refused with advice, vLLM's spellings
work, and values that can be checked without the model fail before the engine process starts, printed once.

Each case runs ``vllite`` in a subprocess, as users do. Start-up failures must not start an engine: the checks that
could also fail in the engine pass an executor that does not exist, so an engine that started would name it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllite.logging_utils import TRACEBACKS_ENV

FAKE_EXECUTOR = "vllite.testing.executors:PositionTokenExecutor"
NEVER_IMPORTED = "vllite_never_imported_executor:Executor"  # an engine that starts fails naming this


def _vllite(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != TRACEBACKS_ENV}
    env["VLLITE_ENABLE_MULTIPROCESSING"] = "1"  # as users run it: the engine in its own process
    return subprocess.run(
        [sys.executable, "-m", "vllite.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _lines(stderr: str) -> list[str]:
    """stderr without blank lines and progress bars."""
    return [line for line in stderr.splitlines() if line.strip() and "it/s]" not in line and "%|" not in line]


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed start-up prints (asserts there is exactly one, and no engine process spoke)."""
    lines = _lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("vllite: error: "), result.stderr
    assert NEVER_IMPORTED.split(":")[0] not in result.stderr, result.stderr  # the engine never started
    return lines[0]


def _command(command: str, *args: str) -> list[str]:
    return [command, *args, *(["hi"] if command == "generate" else ["--port", "0"])]


UNSUPPORTED = [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size", "for scale-out use -dp N (--data-parallel-size)"),
    (["-tp", "2"], "-tp (--tensor-parallel-size)", "-dp N (--data-parallel-size)"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size", "-dp N"),
    (["--cpu-offload-gb", "4"], "--cpu-offload-gb", "weights fit"),
    (["--swap-space", "4"], "--swap-space", "--kv-offload-size"),
    (["--speculative-model", "foo"], "--speculative-model", "--speculative-config"),
    (["--load-format", "dummy"], "--load-format", "safetensors"),
]


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize(("args", "named", "advice"), UNSUPPORTED, ids=[case[1] for case in UNSUPPORTED])
def test_a_vllm_flag_vllite_lacks_is_refused_with_what_to_use_instead(command, args, named, advice):
    result = _vllite(*_command(command, *args))
    assert result.returncode == 2
    line = _error_line(result)
    assert line.startswith(f"vllite: error: {named} is not supported by vllite yet; "), line
    assert advice in line
    assert "usage:" not in result.stderr and "unrecognized arguments" not in result.stderr


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_vllm_no_op_flags_are_accepted(command):
    extra = ["--disable-log-requests"] if command == "serve" else []
    result = _vllite(*_command(command, "--enforce-eager", *extra, "--scheduler-cls", "nosuch"))
    line = _error_line(result)
    assert "Unknown scheduler 'nosuch'" in line  # the flags were accepted; the bad scheduler stopped the start


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_vllm_underscore_spellings_are_accepted(command):
    result = _vllite(*_command(command, "--max_model_len", "5000", "--scheduling_policy=fcfs"))
    line = _error_line(result)
    assert "max_model_len=5000 exceeds the model's max_position_embeddings=1024" in line


@pytest.mark.parametrize("dtype", ["half", "float16", "bfloat16", "float", "float32"])
def test_vllm_dtype_names_are_accepted(dtype):
    result = _vllite("generate", "--dtype", dtype, "--scheduler-cls", "nosuch", "hi")
    line = _error_line(result)
    assert "Unknown scheduler 'nosuch'" in line


def test_dtype_half_means_float16():
    from vllite.engine_args import EngineArgs

    assert EngineArgs(dtype="half").create_engine_config().model_config.dtype == "float16"
    assert EngineArgs(dtype="float").create_engine_config().model_config.dtype == "float32"


def test_gpu_memory_utilization_on_the_cpu_is_warned_about_once():
    result = _vllite("generate", "--device", "cpu", "--gpu-memory-utilization", "0.5", "--max-tokens", "1", "hi")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in _lines(result.stderr) if "--gpu-memory-utilization" in line]
    assert len(warnings) == 1, result.stderr
    assert "--cpu-kvcache-space" in warnings[0]


CHECKABLE = [
    (["--scheduler-cls", "nosuch", "--executor", NEVER_IMPORTED], "Unknown scheduler 'nosuch'"),
    (["--scheduling-policy", "nosuch", "--executor", NEVER_IMPORTED], "'nosuch'"),
    (["--kv-transfer-config", '{"kv_connector": "nosuch"}', "--executor", NEVER_IMPORTED], "'nosuch'"),
    (["--structured-outputs-config", '{"backend": "nosuch"}', "--executor", NEVER_IMPORTED], "'nosuch'"),
    (["--device", "nosuch"], "Unknown executor 'nosuch'"),
    (["--executor", "nosuch"], "Unknown executor 'nosuch'"),
    (["--max-model-len", "5000"], "max_model_len=5000 exceeds the model's max_position_embeddings=1024"),
]


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize(("args", "named"), CHECKABLE, ids=[case[0][0] for case in CHECKABLE])
def test_values_checkable_without_the_model_fail_before_the_engine_starts(command, args, named):
    result = _vllite(*_command(command, *args))
    assert result.returncode in (1, 2)
    line = _error_line(result)
    assert named in line
    assert "EngineCore" not in result.stderr and "Engine core initialization failed" not in line


def test_an_engine_start_up_failure_is_printed_once():
    result = _vllite("generate", "--executor", FAKE_EXECUTOR, "--scheduler-cls", "no_such_policy.mod:Policy", "hi")
    assert result.returncode == 1
    lines = _lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("vllite: error: Engine core initialization failed: ") and "no_such_policy" in lines[0]


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_flag_and_its_values():
    result = _vllite("generate", "--kv-cache-dtype", "fp16", "--executor", NEVER_IMPORTED, "hi")
    assert result.returncode == 2
    assert "argument --kv-cache-dtype: invalid choice: 'fp16'" in result.stderr
    assert all(value in result.stderr for value in ("'auto'", "'fp8'", "'fp8_e4m3'", "'fp8_e5m2'"))
    assert "vllite_never_imported_executor" not in result.stderr  # refused while parsing, no engine started


def test_fp8_kv_cache_with_a_kv_connector_is_refused_before_the_engine_starts():
    result = _vllite(*_command("generate", "--kv-cache-dtype", "fp8", "--kv-offload-size", "1"))
    line = _error_line(result)
    assert "--kv-cache-dtype fp8 cannot be combined with a KV connector" in line
