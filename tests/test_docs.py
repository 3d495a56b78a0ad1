"""The docs run as written: every shell and Python block of README.md and docs/*.md runs and succeeds, unless an
explicit ``<!-- doc-test: skip (reason) -->`` comment right before it (blank lines and other HTML comments may sit
between) says why not.

Blocks run in a fresh temporary directory, shell ones through bash (``console`` blocks: their ``$ `` lines),
Python ones as a script, each in its own process with a timeout; ``vllite`` is this interpreter's script.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py"}
TIMEOUT_S = 240

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)\s*$")
_COMMENT = re.compile(r"^<!--.*-->$")
_SKIP = re.compile(r"^<!--\s*doc-test:\s*skip\s*\((?P<reason>.+)\)\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts, its language, its text, and the reason it is skipped (if marked)."""

    path: Path
    line: int
    lang: str
    text: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _skip_reason(lines: list[str], fence_index: int) -> str | None:
    """The reason of a skip marker among the blank and comment lines right above the fence, if any."""
    index = fence_index - 1
    while index >= 0 and (not lines[index].strip() or _COMMENT.match(lines[index].strip())):
        marker = _SKIP.match(lines[index].strip())
        if marker:
            return marker["reason"].strip()
        index -= 1
    return None


def extract_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` (any language), with its skip marker."""
    lines = path.read_text().splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, lang = opening.groups()
        end = index + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        text = "\n".join(lines[index + 1 : end]) + "\n"
        blocks.append(Block(path, index + 1, lang.lower(), text, _skip_reason(lines, index)))
        index = end + 1
    return blocks


def runnable_blocks() -> list[Block]:
    return [block for path in DOC_FILES for block in extract_blocks(path) if block.lang in SHELL | PYTHON]


def _console_script(text: str) -> str:
    """The commands of a ``console`` block: its ``$ `` lines and their ``\\`` continuations, not the output."""
    commands, continuing = [], False
    for line in text.splitlines():
        if line.startswith("$ ") or continuing:
            commands.append(line[2:] if line.startswith("$ ") and not continuing else line)
            continuing = line.endswith("\\")
    return "\n".join(commands) + "\n"


def _run(block: Block, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("VLLITE_ENABLE_MULTIPROCESSING", "0")
    if block.lang in PYTHON:
        script = cwd / "block.py"
        script.write_text(block.text)
        command = [sys.executable, str(script)]
    else:
        text = _console_script(block.text) if block.lang == "console" else block.text
        command = ["bash", "-euo", "pipefail", "-c", text]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


BLOCKS = runnable_blocks()


# Marked slow: about 40 s in all on two cores (engine start-ups), though no single block takes 10 s.
@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_doc_block_runs_or_is_marked_skipped(block: Block, tmp_path: Path) -> None:
    if block.skip_reason is not None:
        pytest.skip(f"marked in the docs: {block.skip_reason}")
    result = _run(block, tmp_path)
    assert result.returncode == 0, (
        f"{block.id} ({block.lang}) failed with exit code {result.returncode}; mark it "
        "<!-- doc-test: skip (reason) --> only if it cannot run here.\n"
        f"--- block ---\n{block.text}--- stdout ---\n{result.stdout[-3000:]}--- stderr ---\n{result.stderr[-3000:]}"
    )


def test_the_docs_have_runnable_blocks_and_every_skip_names_a_reason() -> None:
    assert len([b for b in BLOCKS if b.skip_reason is None]) >= 5
    for path in DOC_FILES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "doc-test:" in line:
                assert _SKIP.match(line.strip()), f"{path.relative_to(ROOT)}:{number}: malformed marker {line!r}"


def test_extraction_finds_markers_and_console_commands(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- doc-test: skip (needs a GPU) -->\n<!-- other -->\n\n```bash\nnvidia-smi\n```\n\n"
        "````python\nprint('```')\n````\n\n```console\n$ echo a \\\n  b\na b\n```\n"
    )
    blocks = extract_blocks(doc)
    assert [(b.lang, b.skip_reason) for b in blocks] == [("bash", "needs a GPU"), ("python", None), ("console", None)]
    assert blocks[1].text == "print('```')\n"
    assert _console_script(blocks[2].text) == "echo a \\\n  b\n"


def test_extras_are_installed_from_the_checkout() -> None:
    """vllite is not on the package index, so an extra comes from the checkout (`pip install ".[ray]"`), never
    `pip install vllite[ray]`."""
    for path in DOC_FILES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"pip install ['\"]?vllite\[", line), f"{path.relative_to(ROOT)}:{number}: {line}"
    assert 'pip install ".[ray]"' in (ROOT / "docs" / "data-parallel.md").read_text()


DP_READY_SCRIPT = """
import logging

from vllite import LLM

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    with LLM(data_parallel_size=2, max_model_len=64, executor="vllite.testing.executors:PositionTokenExecutor") as llm:
        print(len(llm.llm_engine.engine_core.engines), "engines")
"""


@pytest.mark.slow
def test_the_data_parallel_readiness_check_works_as_documented(tmp_path: Path) -> None:
    """docs/data-parallel.md: the engines list is the check; the `Engine core ready` lines need INFO logging (the
    default, WARNING, hides them), and then every engine prints one."""
    doc = (ROOT / "docs" / "data-parallel.md").read_text()
    assert "llm.llm_engine.engine_core.engines" in doc
    assert "`Engine core ready` at INFO level" in doc and "logging.basicConfig(level=logging.INFO)" in doc
    script = tmp_path / "ready.py"
    script.write_text(DP_READY_SCRIPT)
    env = {**os.environ, "VLLITE_ENABLE_MULTIPROCESSING": "1"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "2 engines"
    assert result.stderr.count("Engine core ready") == 2, result.stderr[-3000:]
