"""Tracebacks in log records, on or off: the CLI hides them unless ``--debug``, in its process and the engine's.

A failure's cause already reaches the caller as a value (``EngineStartupError``, ``EngineDeadError``, a request's
error), so a command-line user needs one line, not the engine process's 40-line traceback. ``VLLITE_LOG_TRACEBACKS=0``
(set by ``vllite`` without ``--debug``; the engine process inherits it) turns each logged exception into one
``Type: message`` suffix. Unset or any other value keeps Python's usual tracebacks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

TRACEBACKS_ENV = "VLLITE_LOG_TRACEBACKS"


def tracebacks_enabled() -> bool:
    """False only when ``VLLITE_LOG_TRACEBACKS`` is ``0`` (or ``false``)."""
    return os.environ.get(TRACEBACKS_ENV, "1").strip().lower() not in ("0", "false")


class OneLineExceptionFilter(logging.Filter):
    """Replaces a record's traceback by ``": Type: message"`` after its message (the record is changed in place)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            record.msg = f"{record.getMessage().rstrip('.')}: {type(exc).__name__}: {exc}"
            record.args = None
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return True


def hide_tracebacks_if_requested(handlers: Iterable[logging.Handler]) -> None:
    """Adds :class:`OneLineExceptionFilter` to ``handlers`` when ``VLLITE_LOG_TRACEBACKS=0``."""
    if tracebacks_enabled():
        return
    for handler in handlers:
        if not any(isinstance(f, OneLineExceptionFilter) for f in handler.filters):
            handler.addFilter(OneLineExceptionFilter())
