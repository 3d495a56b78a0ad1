"""``vllite serve`` as a child process that a test starts, reads and stops like a user's terminal would."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

READY = re.compile(r"vllite: serving .* on (https?://\S+) ")


class ServeProcess:
    """``vllite serve ARGS --port 0`` in a child process; ``url`` once it prints where it serves (its banner comes
    once every API server is ready), ``log`` its output so far, ``stop()`` a SIGINT and the exit code."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, start_timeout_s: float = 180) -> None:
        argv = [sys.executable, "-m", "vllite.cli", "serve", "--port", "0", "--disable-uvicorn-access-log", *args]
        full_env = {**os.environ, **(env or {})}
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
        self.log: list[str] = []
        self.url = ""
        assert self.process.stdout is not None
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            self.log.append(line)
            match = READY.search(line)
            if match:
                self.url = match.group(1)
                break
        if not self.url:
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.log[-30:]))
        threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True).start()

    def stop(self, timeout_s: float = 90) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
