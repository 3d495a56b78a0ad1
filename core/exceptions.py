"""The one small exception hierarchy of vllite.

Every error the engine raises on purpose derives from :class:`VlliteError`, so callers can catch the
engine's own failures without swallowing programming errors. Bad user input stays a plain
``ValueError`` (as in vLLM), because that is what users and HTTP layers already map to a 400.
"""

from __future__ import annotations


class VlliteError(Exception):
    """Base class of every error vllite raises deliberately."""


class PluginLoadError(VlliteError):
    """A plugin could not be loaded, or does not satisfy the interface it claims.

    The message always names the plugin: the distribution, the entry point (or class path) and the cause.
    """

    def __init__(self, message: str, *, plugin: str | None = None, distribution: str | None = None):
        super().__init__(message)
        self.plugin = plugin
        self.distribution = distribution


class UnknownComponentError(VlliteError, ValueError):
    """A component name (scheduler, executor, ...) that no plugin registered; the message lists the known ones."""


class DuplicateComponentError(PluginLoadError):
    """Two plugins registered the same component name; the message names both."""


class EngineDeadError(VlliteError):
    """The engine core died (crashed, killed, or its executor failed); in-flight requests cannot finish."""

    def __init__(
        self,
        message: str = "The engine core has died; see the log above for the cause.",
        *,
        suppress_context: bool = False,
    ):
        super().__init__(message)
        if suppress_context:
            self.__suppress_context__ = True


class ModelLoadError(VlliteError, ValueError):
    """A model folder is missing, incomplete (no config or tokenizer), or of an unsupported architecture."""


class KVCacheMemoryError(VlliteError, ValueError):
    """The KV cache cannot hold one sequence of ``max_model_len`` tokens in the configured memory budget."""
