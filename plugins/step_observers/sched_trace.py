"""Scheduler tracing: one JSON line per engine step, written to ``$VLLITE_SCHED_TRACE_PATH``.

A builtin plugin on the ``vllite_step_observer`` hook. The hook implementation exists only when the variable is
set when this module is first imported (engine start-up), so with tracing off no plugin implements the hook and
the scheduler never builds a step record: off costs nothing. Each line holds the step number and time, queue
sizes, free and cached blocks, KV usage, the prefix-cache hit (tokens) of every request admitted in the step,
and the decision: ``new`` / ``resumed`` / ``running`` (request id → tokens scheduled) and ``preempted``
(request id → computed tokens thrown away). The file is closed at interpreter exit.

To trace one engine explicitly (tests, notebooks), register ``StepTracer(path)`` as a plugin object.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from typing import IO, Any

from vllite.hookspecs import hookimpl

TRACE_PATH_ENV = "VLLITE_SCHED_TRACE_PATH"


class StepTracer:
    """Appends each step record as one JSON line to ``path``; the file opens on the first record.

    Promises: one line per call, flushed at once (a crash loses at most the step being written); safe to
    share between engines of one process; ``close()`` is idempotent and a later record reopens the file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

    @hookimpl
    def vllite_step_observer(self, step: dict[str, Any]) -> None:
        """Writes ``step`` as one JSON line."""
        line = json.dumps(step, separators=(",", ":"), default=str)
        with self._lock:
            if self._file is None:
                directory = os.path.dirname(self.path)
                if directory:
                    os.makedirs(directory, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across steps
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        """Closes the file (if open)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


_trace_path = os.environ.get(TRACE_PATH_ENV, "").strip()
tracer: StepTracer | None = StepTracer(_trace_path) if _trace_path else None

if tracer is not None:
    _active = tracer
    atexit.register(tracer.close)

    @hookimpl
    def vllite_step_observer(step: dict[str, Any]) -> None:
        """Writes the step record to ``$VLLITE_SCHED_TRACE_PATH`` (defined only when the variable is set)."""
        _active.vllite_step_observer(step)

else:
    # importlib.reload re-runs this module in its old namespace: a hook defined by an earlier run with tracing on
    # would survive, and its next record would reopen the closed trace file.
    globals().pop("vllite_step_observer", None)
    globals().pop("_active", None)
