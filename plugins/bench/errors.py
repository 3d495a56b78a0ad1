"""The benchmarks' errors: a replay that cannot progress, a server that cannot be benchmarked."""

from __future__ import annotations

from vllite.exceptions import VlliteError


class BenchReplayError(VlliteError, RuntimeError):
    """The agent-bench replay cannot progress: jobs are unfinished with nothing in flight, or the engine stalled."""


class ServeBenchError(VlliteError, RuntimeError):
    """``vllite bench serve`` cannot run: the server is unreachable, lists no model, or fails the warm-up request."""
