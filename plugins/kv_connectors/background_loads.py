"""Asynchronous KV loads: a connector worker's background load threads, and how each load ended, handed back to
the step (``get_finished`` / ``get_block_ids_with_load_errors``). Used by the ``offload`` and ``p2p`` workers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec

_P = ParamSpec("_P")


class BackgroundLoads:
    """Runs a worker's loads on a thread pool and collects how they ended.

    Promises: :meth:`finish` is safe from any thread; :meth:`take_finished` and :meth:`take_load_errors` hand out
    every request and failed block reported so far exactly once; :meth:`wait_idle` and :meth:`shutdown` return
    only once every load submitted before them has ended. A load reports its own end (landed or failed) through
    :meth:`finish`: the caller's function must never end without it, or the request would wait forever.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._inflight: list[Future[None]] = []
        self._lock = threading.Lock()  # guards everything finish() writes
        self._finished: set[str] = set()
        self._load_errors: set[int] = set()
        self.num_blocks_loaded = 0
        self.num_load_errors = 0

    def submit(self, load: Callable[_P, None], *args: _P.args, **kwargs: _P.kwargs) -> None:
        """Runs ``load(*args, **kwargs)`` on a load thread."""
        self._inflight.append(self._pool.submit(load, *args, **kwargs))

    def finish(self, req_id: str, num_loaded: int, failed: set[int]) -> None:
        """A load thread's report: ``req_id``'s load ended, ``num_loaded`` blocks landed, ``failed`` did not."""
        with self._lock:
            self._finished.add(req_id)
            self._load_errors |= failed
            self.num_blocks_loaded += num_loaded
            self.num_load_errors += len(failed)

    def take_finished(self) -> set[str]:
        """Requests whose load ended (landed or failed) since the previous call."""
        self._inflight = [f for f in self._inflight if not f.done()]
        with self._lock:
            finished, self._finished = self._finished, set()
        return finished

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed since the previous call."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_idle(self) -> None:
        """Blocks until every submitted load has ended (tests, shutdown)."""
        for future in list(self._inflight):
            future.result()

    def shutdown(self) -> None:
        """Waits for the loads in flight and stops the threads."""
        self._pool.shutdown(wait=True)
