"""The engine process starts without re-running the user's script: README's Python examples run as plain files.

multiprocessing's spawn would re-import the script in the engine process, where its module-level ``LLM()`` tries
to start an engine of its own; the client hides ``__main__`` from spawn unless the engine's arguments need it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_docs import ROOT, extract_blocks
from vllite.plugins.engine_proc.spawning import main_module_hidden_from_spawn, refers_to_main

README_PYTHON = [
    block for block in extract_blocks(ROOT / "README.md") if block.lang == "python" and not block.skip_reason
]


def _run_as_script(source: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "example.py"
    script.write_text(source)
    env = {**os.environ, "VLLITE_ENABLE_MULTIPROCESSING": "1"}  # the default users get
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize("block", README_PYTHON, ids=[block.id for block in README_PYTHON])
def test_readme_python_example_runs_as_a_plain_script(block, tmp_path):
    result = _run_as_script(block.text, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


def test_a_module_level_llm_without_a_main_guard(tmp_path):
    source = (
        "from vllite import LLM, SamplingParams\n"
        "llm = LLM()\n"
        "out = llm.generate(['def f(x):'], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)\n"
        "print('OK', len(out[0].outputs[0].token_ids))\n"
        "llm.shutdown()\n"
    )
    result = _run_as_script(source, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK 4" in result.stdout


class DefinedHere:
    pass


def test_main_stays_visible_when_the_engine_needs_it():
    main = sys.modules["__main__"]
    spec, file = main.__spec__, getattr(main, "__file__", None)
    assert not refers_to_main(("config", 1)) and refers_to_main(type("X", (), {"__module__": "__main__"}))
    with main_module_hidden_from_spawn(("config", DefinedHere)) as hidden:
        assert hidden and main.__spec__ is None and not hasattr(main, "__file__")
    assert main.__spec__ is spec and getattr(main, "__file__", None) == file
