"""A real ``vllite serve`` process on loopback (an ephemeral port) for tests and benchmarks; stopped by SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from vllite.exceptions import EngineStartupError

FORCED_SEQUENCE = "vllite.testing.logitsprocs:ForcedSequenceLogitsProcessor"
_READY = re.compile(r"vllite: serving .* on (https?://\S+) ")


class RemoteServer:
    """``vllite serve ARGS --port 0`` (or another serving ``command``, such as ``disagg-proxy``) in a child process;
    ``url`` (``http://127.0.0.1:PORT``) once it is ready.

    The child's output is collected in ``log`` (and echoed on failure). ``stop()`` sends SIGINT and waits;
    ``kill()`` SIGKILLs the server and every process it started (its engine core), as a crash would.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        env: dict[str, str] | None = None,
        timeout_s: float = 120.0,
        command: str = "serve",
    ):
        argv = [sys.executable, "-m", "vllite.cli", command, "--port", "0", "--disable-uvicorn-access-log", *args]
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.log: list[str] = []
        self._new_line = threading.Condition()
        self.url = self._wait_ready(timeout_s, command)
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float, command: str) -> str:
        deadline = time.monotonic() + timeout_s
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            self.log.append(line)
            match = _READY.search(line)
            if match:
                return match.group(1)
        self.process.kill()
        self.process.wait()
        raise EngineStartupError(f"vllite {command} did not start:\n" + "".join(self.log[-40:]))

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._new_line:
                self.log.append(line)
                self._new_line.notify_all()

    def wait_for_log(self, pattern: str, *, start: int = 0, timeout_s: float = 60.0) -> str:
        """The first line of ``log`` from index ``start`` on that matches the regular expression ``pattern``, waiting
        for the server to print it; ``TimeoutError`` (with the log's tail) when it has not after ``timeout_s``."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._new_line:
            while True:
                found = next((line for line in self.log[start:] if regex.search(line)), None)
                if found is not None:
                    return found
                start = max(start, len(self.log))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no log line matched {pattern!r}:\n" + "".join(self.log[-30:]))
                self._new_line.wait(left)

    @property
    def base_url(self) -> str:
        """The OpenAI client's ``base_url``."""
        return self.url + "/v1"

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGINT, then wait for the exit (kill after ``timeout_s``); returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL to the server and its descendants (children first found, then killed), and wait for it."""
        victims = [self.process.pid, *_descendants(self.process.pid)]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        self._reader.join(5)

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from ``/proc``; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found
