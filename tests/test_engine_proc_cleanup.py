"""Cleanup after the frontend dies by SIGKILL (issue 13): the engine exits and removes the private IPC directory;
stale directories of dead owners are swept at the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from vllite.plugins.engine_proc.utils import sweep_stale_ipc_dirs

FRONTEND = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {root!r})
    from tests.test_engine_proc import make_config
    from vllite.plugins.engine_proc.client import SyncMPClient

    if __name__ == "__main__":
        client = SyncMPClient(make_config())
        print(client.resources.endpoints.ipc_dir, client.resources.proc.pid, flush=True)
        threading.Event().wait(60)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not reaped by the dead frontend's init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigkilled_frontend_leaves_no_engine_and_no_ipc_directory(tmp_path):
    script = tmp_path / "frontend.py"
    script.write_text(FRONTEND.format(root=os.getcwd()))
    frontend = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = frontend.stdout.readline()
        ipc_dir, engine_pid = line.split()[0], int(line.split()[1])
        assert os.path.isdir(ipc_dir)
        os.kill(frontend.pid, signal.SIGKILL)
        frontend.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (os.path.exists(ipc_dir) or _alive(engine_pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(engine_pid)
        assert not os.path.exists(ipc_dir)
    finally:
        if frontend.poll() is None:
            frontend.kill()
            frontend.wait(timeout=10)


def test_stale_ipc_directories_of_dead_owners_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = tmp_path / f"vllite-{dead.pid}-abc"
    live = tmp_path / f"vllite-{os.getpid()}-abc"
    other = tmp_path / "vllite-notapid"
    for path in (stale, live, other):
        path.mkdir()
    sweep_stale_ipc_dirs(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists()
