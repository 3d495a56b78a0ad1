"""Ctrl-C (issue 28, item 1), through real processes: a terminal's Ctrl-C sends SIGINT to the whole foreground
process group, so each test starts its process in a session of its own and interrupts the group (or the process
interrupts its own group, as a terminal would).

- ``vllite generate`` / ``vllite chat``: stop printing, say ``vllite: interrupted``, shut the engine down, exit 130.
- ``LLM.generate`` / ``AsyncLLM.generate`` (engine process or in-process): ``KeyboardInterrupt`` reaches the caller,
  the requests in flight are aborted (their KV blocks freed), and the same engine serves the next call correctly.
- Ctrl-C while the engine starts: ``interrupted``, no hint about an ``if __name__ == "__main__"`` guard.

The interrupt inside the Python API comes from a logits processor (``interrupter.InterruptAt``) at a fixed step of
the interrupted call, so it always lands while requests are in flight (in-process: in the middle of a step). Two
quick checks in this process pin the pieces: the in-process engine's ``sigint_deferred``, and the engine death
message naming the signal.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

INTERRUPTER = '''
import os
import signal


class InterruptAt:
    """A no-op logits processor that, once the file $INTERRUPT_ARM_FILE exists, sends SIGINT to its process group
    (what a terminal's Ctrl-C does) at the third step, once per process."""

    fired = False

    def __init__(self, vllm_config, device, is_pin_memory):
        self.armed_steps = 0

    def is_argmax_invariant(self):
        return False  # applied to greedy requests too

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        if not InterruptAt.fired and os.path.exists(os.environ["INTERRUPT_ARM_FILE"]):
            self.armed_steps += 1
            if self.armed_steps == 3:
                InterruptAt.fired = True
                os.killpg(0, signal.SIGINT)
        return logits
'''

LLM_SCRIPT = """
import json, os, sys, traceback
from pathlib import Path
from vllite import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np"]

def tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]

def main():
    llm = LLM(logits_processors=["interrupter:InterruptAt"], seed=0)
    short = SamplingParams(temperature=0, max_tokens=12)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    before = tokens(llm.generate(PROMPTS, short, use_tqdm=False))
    Path(os.environ["INTERRUPT_ARM_FILE"]).touch()
    result = {"interrupted": False}
    try:
        llm.generate(PROMPTS * 4, long, use_tqdm=False)
    except KeyboardInterrupt as exc:
        result["interrupted"] = True
        # In-process, the engine steps in this thread: the interrupt must wait for the step to end, not cut it.
        result["cut_mid_step"] = any(frame.name == "apply" for frame in traceback.extract_tb(exc.__traceback__))
    result["frontend_unfinished"] = llm.llm_engine.get_num_unfinished_requests()
    result["engine_unfinished"] = llm.llm_engine.engine_core.call_utility("get_num_unfinished_requests")
    result["kv_usage"] = llm.llm_engine.engine_core.call_utility("get_kv_cache_usage")
    result["after"] = tokens(llm.generate(PROMPTS, short, use_tqdm=False))
    result["before"] = before
    print("RESULT " + json.dumps(result), flush=True)
    llm.shutdown()

if __name__ == "__main__":
    main()
"""

ASYNC_LLM_SCRIPT = """
import asyncio, json, os
from pathlib import Path
from vllite import AsyncLLM, SamplingParams
from vllite.sampling_params import RequestOutputKind

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np"]

async def run(llm, params, tag):
    async def one(i, prompt):
        final = None
        async for out in llm.generate(prompt, params, f"{tag}-{i}"):
            final = out
        return list(final.outputs[0].token_ids)
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS * (1 if tag != "long" else 4))))

def main():
    llm = AsyncLLM(logits_processors=["interrupter:InterruptAt"], seed=0)
    short = SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    before = asyncio.run(run(llm, short, "before"))
    Path(os.environ["INTERRUPT_ARM_FILE"]).touch()
    result = {"interrupted": False}
    try:
        asyncio.run(run(llm, long, "long"))
    except KeyboardInterrupt:
        result["interrupted"] = True
    result["frontend_unfinished"] = llm.output_processor.get_num_unfinished_requests()
    result["engine_unfinished"] = asyncio.run(llm.call_utility("get_num_unfinished_requests"))
    result["kv_usage"] = asyncio.run(llm.call_utility("get_kv_cache_usage"))
    result["after"] = asyncio.run(run(llm, short, "after"))
    result["before"] = before
    print("RESULT " + json.dumps(result), flush=True)
    llm.shutdown()

if __name__ == "__main__":
    main()
"""


@pytest.fixture(autouse=True)
def _sigint_delivered():
    """Ctrl-C reaches these tests and the processes they start even when the test run itself was started with SIGINT
    ignored (as a background job of a non-interactive shell is): a Python handler here resets to the default in the
    children at exec, where an ignored signal would stay ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _env(tmp_path: Path, *, multiprocessing: bool = True) -> dict[str, str]:
    env = {
        **os.environ,
        "VLLITE_ENABLE_MULTIPROCESSING": "1" if multiprocessing else "0",
        "INTERRUPT_ARM_FILE": str(tmp_path / "armed"),
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("VLLITE_PLUGINS", None)
    return env


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _assert_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    """Waits until no process of the group is left (the engine process included)."""
    deadline = time.monotonic() + timeout_s
    while _group_members(pgid):
        if time.monotonic() > deadline:
            os.killpg(pgid, signal.SIGKILL)
            pytest.fail(f"processes left in the group after exit: {_group_members(pgid)}")
        time.sleep(0.05)


class _Process:
    """A command in a session of its own, its stdout read line by line as it comes, its stderr collected."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, stdin: str | None = None) -> None:
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        if stdin is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(stdin)
            self.proc.stdin.close()
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []
        self.stderr = ""
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()

    def next_line(self, deadline: float) -> str | None:
        """The next stdout line, or None at EOF; fails the test at ``deadline``."""
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self.kill()
            pytest.fail(f"no output in time; stderr: {self.stderr[-2000:]}")
        if line is not None:
            self.stdout.append(line)
        return line

    def interrupt(self) -> None:
        """Ctrl-C: SIGINT to the whole process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait(self, timeout_s: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"did not exit in time after the interrupt; stderr: {self.stderr[-2000:]}")
        while self.next_line(time.monotonic() + 10) is not None:
            pass
        for thread in self._threads:
            thread.join(timeout=10)
        return code

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _vllite(*args: str) -> list[str]:
    return [sys.executable, "-m", "vllite.cli", *args]


SEPARATOR = "-" * 40
PROMPT = "def fibonacci(n):"


def test_generate_cli_stops_printing_says_interrupted_and_exits_130(tmp_path):
    # Two requests at a time, so completions finish (and are printed) one after another for a while.
    argv = _vllite("generate", "--max-tokens", "48", "--max-num-seqs", "2", *[PROMPT] * 60)
    process = _Process(argv, _env(tmp_path), tmp_path)
    deadline = time.monotonic() + 180
    while (line := process.next_line(deadline)) is not None and line.rstrip("\n") != SEPARATOR:
        pass  # the first completion, up to its separator
    assert line is not None, f"exited before printing a completion: {process.stderr[-2000:]}"
    process.interrupt()
    code = process.wait()
    _assert_group_gone(process.proc.pid)
    assert code == 130, process.stderr[-3000:]
    assert process.stderr.rstrip().endswith("vllite: interrupted"), process.stderr[-3000:]
    assert "Traceback" not in process.stderr and "error" not in process.stderr, process.stderr[-3000:]
    blocks = [block.strip() for block in "".join(process.stdout).split(SEPARATOR) if block.strip()]
    assert 1 <= len(blocks) < 60, "printing did not stop at the interrupt"
    assert all(block.startswith(PROMPT) and len(block) > len(PROMPT) for block in blocks), blocks


def test_chat_cli_interrupted_mid_reply_exits_130(tmp_path):
    (tmp_path / "interrupter.py").write_text(INTERRUPTER)
    (tmp_path / "armed").touch()
    argv = _vllite("chat", "--max-tokens", "64", "--logits-processors", "interrupter:InterruptAt")
    process = _Process(argv, _env(tmp_path), tmp_path, stdin="Write a long story.\nAnother one.\n")
    code = process.wait(timeout_s=180)
    _assert_group_gone(process.proc.pid)
    assert code == 130, process.stderr[-3000:]
    assert process.stderr.rstrip().endswith("vllite: interrupted"), process.stderr[-3000:]
    assert "Traceback" not in process.stderr and "error" not in process.stderr, process.stderr[-3000:]
    assert "".join(process.stdout).strip() in ("", ">"), "an interrupted reply must not be printed"


def _engine_children(pid: int) -> list[int]:
    children: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                children += [int(child) for child in handle.read().split()]
        except OSError:
            pass
    return children


def test_interrupt_during_engine_start_up_says_interrupted(tmp_path):
    process = _Process(_vllite("generate", "--max-tokens", "4", PROMPT), _env(tmp_path), tmp_path)
    deadline = time.monotonic() + 120
    while not _engine_children(process.proc.pid):  # the engine process is starting
        if process.proc.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no engine process started: {process.stderr[-2000:]}")
        time.sleep(0.02)
    process.interrupt()  # the engine process has just been spawned: seconds of imports and loading lie ahead
    code = process.wait()
    _assert_group_gone(process.proc.pid)
    assert code == 130, process.stderr[-3000:]
    assert process.stderr.rstrip().endswith("vllite: interrupted"), process.stderr[-3000:]
    assert "__main__" not in process.stderr and "Traceback" not in process.stderr, process.stderr[-3000:]
    assert "error" not in process.stderr, process.stderr[-3000:]


def _run_script(tmp_path: Path, source: str, *, multiprocessing: bool = True) -> dict:
    (tmp_path / "interrupter.py").write_text(INTERRUPTER)
    (tmp_path / "script.py").write_text(source)
    process = _Process([sys.executable, "script.py"], _env(tmp_path, multiprocessing=multiprocessing), tmp_path)
    code = process.wait(timeout_s=240)
    _assert_group_gone(process.proc.pid)
    assert code == 0, process.stderr[-3000:]
    results = [line for line in process.stdout if line.startswith("RESULT ")]
    assert results, process.stderr[-3000:]
    return json.loads(results[-1][len("RESULT ") :])


def _assert_recovered(result: dict) -> None:
    assert result["interrupted"], "KeyboardInterrupt did not reach the caller"
    assert not result.get("cut_mid_step"), "the interrupt cut an engine step half-way"
    assert result["frontend_unfinished"] == 0 and result["engine_unfinished"] == 0, result
    assert result["kv_usage"] == 0, "the interrupted requests' KV blocks were not freed"
    assert result["after"] == result["before"], "the next call after the interrupt gave other tokens"


def test_llm_generate_interrupted_raises_and_the_llm_keeps_working(tmp_path):
    _assert_recovered(_run_script(tmp_path, LLM_SCRIPT))


def test_in_process_llm_interrupted_mid_step_keeps_working(tmp_path):
    _assert_recovered(_run_script(tmp_path, LLM_SCRIPT, multiprocessing=False))


def test_async_llm_interrupted_raises_and_keeps_working(tmp_path):
    _assert_recovered(_run_script(tmp_path, ASYNC_LLM_SCRIPT))


def _spin() -> None:
    for _ in range(10_000):  # bytecodes: Python runs a pending signal's handler here
        pass


def test_an_in_process_step_is_not_cut_by_a_ctrl_c_and_a_second_one_raises_at_once():
    from vllite.engine.core_client import sigint_deferred

    done: list[str] = []

    def step() -> str:
        os.kill(os.getpid(), signal.SIGINT)
        _spin()
        done.append("step")
        return "outputs"

    with pytest.raises(KeyboardInterrupt):
        sigint_deferred(step)
    assert done == ["step"]

    def hung_step() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        _spin()
        os.kill(os.getpid(), signal.SIGINT)
        _spin()
        done.append("hung step")

    with pytest.raises(KeyboardInterrupt):
        sigint_deferred(hung_step)
    assert done == ["step"]
    assert sigint_deferred(lambda: "quiet") == "quiet"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_engine_process_death_names_the_signal():
    from vllite.plugins.engine_proc.utils import exit_signal_name

    assert exit_signal_name(-signal.SIGKILL) == "SIGKILL"
    assert exit_signal_name(128 + signal.SIGTERM) == "SIGTERM"  # the engine's own exit on SIGTERM
    assert exit_signal_name(0) is None and exit_signal_name(1) is None and exit_signal_name(None) is None
