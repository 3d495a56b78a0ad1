"""``init_logger`` as vLLM plugins call it: a standard logger with vLLM's ``*_once`` methods."""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, MutableMapping
from typing import Any

_loggers: dict[str, CompatLogger] = {}
_lock = threading.Lock()


class CompatLogger(logging.LoggerAdapter):
    """The logger ``init_logger(name)`` returns: ``logging.getLogger(name)`` plus ``debug_once``, ``info_once``,
    ``warning_once`` and ``error_once``, which log a given message with given arguments once per process.

    Every other attribute (``handlers``, ``level``, ``addHandler`` ...) is the wrapped logger's; records carry the
    caller's file and line, as when logging through the logger itself.
    """

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, None)
        self._seen: set[tuple[int, str, tuple[Hashable, ...]]] = set()

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs  # keep the caller's ``extra``

    def __getattr__(self, name: str) -> Any:
        return getattr(self.logger, name)

    def _once(self, level: int, msg: str, args: tuple[Hashable, ...], kwargs: dict[str, Any]) -> None:
        key = (level, msg, args)
        if key in self._seen:
            return
        self._seen.add(key)
        kwargs.setdefault("stacklevel", 3)  # the caller of debug_once & co., not this module
        self.log(level, msg, *args, **kwargs)

    def debug_once(self, msg: str, *args: Hashable, scope: str = "local", **kwargs: Any) -> None:
        """``debug`` the first time this message is logged with these arguments."""
        self._once(logging.DEBUG, msg, args, kwargs)

    def info_once(self, msg: str, *args: Hashable, scope: str = "local", **kwargs: Any) -> None:
        """``info`` the first time this message is logged with these arguments."""
        self._once(logging.INFO, msg, args, kwargs)

    def warning_once(self, msg: str, *args: Hashable, scope: str = "local", **kwargs: Any) -> None:
        """``warning`` the first time this message is logged with these arguments."""
        self._once(logging.WARNING, msg, args, kwargs)

    def error_once(self, msg: str, *args: Hashable, scope: str = "local", **kwargs: Any) -> None:
        """``error`` the first time this message is logged with these arguments."""
        self._once(logging.ERROR, msg, args, kwargs)


def init_logger(name: str) -> CompatLogger:
    """The logger named ``name`` (one object per name), as vLLM's ``vllm.logger.init_logger`` returns it."""
    with _lock:
        logger = _loggers.get(name)
        if logger is None:
            logger = _loggers[name] = CompatLogger(logging.getLogger(name))
        return logger
