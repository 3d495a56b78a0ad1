"""``torch.profiler`` for the default executor, as vLLM's ``start_profile`` / ``stop_profile``.

``start()`` begins tracing this engine process (CPU activity, and CUDA kernels on a CUDA device, with shapes and
stacks); ``stop()`` ends it and writes one Chrome / TensorBoard trace, ``{name}.{ms}.pt.trace.json.gz``, into the
profiler directory: ``$VLLITE_TORCH_PROFILER_DIR`` (vLLM's ``$VLLM_TORCH_PROFILER_DIR`` is read too; ``vllite
serve --profiler-dir`` sets it). The directory is read when the profiler starts, so the engine process sees what
its parent set before starting it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from vllite.exceptions import ExecutorError

logger = logging.getLogger(__name__)

#: Where traces go; the first one set wins.
PROFILER_DIR_ENVS = ("VLLITE_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")


def profiler_dir() -> str | None:
    """The trace directory the environment names (None: profiling is off)."""
    for name in PROFILER_DIR_ENVS:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


class TorchProfiler:
    """One engine's profiler: at most one trace runs at a time."""

    def __init__(self, device_type: str, worker_name: str) -> None:
        self.device_type = device_type
        self.worker_name = worker_name
        self._profiler: Any = None
        self.trace_dir: Path | None = None

    @property
    def running(self) -> bool:
        """Whether a trace is being recorded."""
        return self._profiler is not None

    def start(self, profile_prefix: str | None = None) -> None:
        """Starts a trace; ``ExecutorError`` when no directory is configured or a trace already runs."""
        import torch

        if self.running:
            raise ExecutorError("The profiler is already running: call stop_profile first.")
        directory = profiler_dir()
        if directory is None:
            raise ExecutorError(
                "The profiler is off: set VLLITE_TORCH_PROFILER_DIR (or VLLM_TORCH_PROFILER_DIR, or start the "
                "server with --profiler-dir) to the directory the traces go to."
            )
        self.trace_dir = Path(directory).expanduser()
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        name = f"{profile_prefix}_{self.worker_name}" if profile_prefix else self.worker_name
        profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=True,
            with_stack=True,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.trace_dir), name, use_gzip=True),
        )
        profiler.start()
        self._profiler = profiler
        logger.info("Profiling started; the trace goes to %s", self.trace_dir)

    def stop(self) -> None:
        """Stops the trace and writes it; ``ExecutorError`` when none runs."""
        if self._profiler is None:
            raise ExecutorError("The profiler is not running: call start_profile first.")
        profiler, self._profiler = self._profiler, None
        profiler.stop()  # runs on_trace_ready: the trace file is written here
        logger.info("Profiling stopped; trace written to %s", self.trace_dir)

    def close(self) -> None:
        """Stops a trace still running (at shutdown), writing it."""
        if self._profiler is not None:
            try:
                self.stop()
            except Exception:  # shutting down: a failed trace write must not mask the shutdown
                logger.exception("Could not write the profiler trace at shutdown")
