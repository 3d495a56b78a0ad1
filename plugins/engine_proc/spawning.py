"""Starting the engine process without re-running the user's script.

multiprocessing's ``spawn`` makes the child import the parent's ``__main__`` (as ``__mp_main__``) so that objects
defined there can be unpickled. For a script that builds an ``LLM`` at module level — README's example saved as a
file and run with ``python file.py`` — that re-runs the script inside the engine process, which then tries to
start an engine of its own and fails. The engine process needs nothing from ``__main__`` unless its arguments refer
to it (a scheduler, executor or logits-processor class defined in the script itself), so ``__main__`` is hidden from
spawn while the process starts, unless they do; then the old rule applies and the script needs its
``if __name__ == "__main__":`` guard.

The engine process also starts with SIGINT blocked (``sigint_blocked``): a terminal's Ctrl-C reaches the whole
foreground process group, and the engine leaves it to the frontend (``entry.py`` then ignores SIGINT for good).
"""

from __future__ import annotations

import pickle
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_MISSING = object()


def refers_to_main(payload: object) -> bool:
    """Whether unpickling ``payload`` needs the ``__main__`` module (conservatively true if it cannot be pickled)."""
    try:
        return b"__main__" in pickle.dumps(payload)
    except Exception:
        return True


@contextmanager
def main_module_hidden_from_spawn(payload: object) -> Iterator[bool]:
    """While the body starts a spawned process, ``__main__`` has no ``__spec__`` or ``__file__``, so the child does
    not import it; yields whether it was hidden (not when ``payload`` refers to ``__main__``)."""
    main = sys.modules.get("__main__")
    if main is None or refers_to_main(payload):
        yield False
        return
    saved_spec = getattr(main, "__spec__", None)
    saved_file = main.__dict__.get("__file__", _MISSING)
    main.__spec__ = None
    if saved_file is not _MISSING:
        del main.__file__
    try:
        yield True
    finally:
        main.__spec__ = saved_spec
        if saved_file is not _MISSING:
            main.__file__ = saved_file


@contextmanager
def sigint_blocked() -> Iterator[None]:
    """Blocks SIGINT in the calling thread (any thread) while the body starts a process, which inherits the mask
    across ``exec``: a Ctrl-C that comes while the engine process starts up is held there, never raised in the
    middle of its imports. A SIGINT meant for this process stays pending meanwhile and is delivered afterwards."""
    from multiprocessing import resource_tracker

    # Spawn starts multiprocessing's resource tracker on first use, and unblocks SIGINT after starting it.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
