"""The one small exception hierarchy of vllite.

Every error the engine raises on purpose derives from :class:`VlliteError`, so callers can catch the
engine's own failures without swallowing programming errors. Bad user input stays a plain
``ValueError`` (as in vLLM), because that is what users and HTTP layers already map to a 400.

The kernel's hierarchy (a class in brackets is a second base, kept so that callers catching it keep working)::

    VlliteError
    ├── PluginLoadError ── DuplicateComponentError
    ├── UnknownComponentError [ValueError], ModelLoadError [ValueError], KVCacheMemoryError [ValueError]
    ├── VLLMValidationError [ValueError], CpuThreadsConfigError [ValueError]
    ├── EngineDeadError
    ├── EngineStartupError [RuntimeError]
    ├── EngineClientError [RuntimeError] ── EngineClientClosedError, EngineClientUsageError, UtilityCallError,
    │                                       RequestProcessingError
    ├── ExecutorError [RuntimeError] ── ExecutorFailedError, ModelExecutionError, ExecutorAsleepError,
    │                                   KVCacheNotAllocatedError, DeviceUnavailableError, AttentionRoutingError
    ├── InternalStateError [RuntimeError] ── KVCacheStateError, BatchStateError
    ├── PluginHookError [RuntimeError], LogitsProcessorRowsError [RuntimeError]
    ├── SessionClosedError [ValueError] (an input chunk for a session that is not open)
    └── RequestFailedError (a request the engine finished with an error; the server answers 500)

A plugin's own errors live in the plugin and derive from :class:`VlliteError` too: the HTTP server's one per status
(``vllite.plugins.openai_server.http_errors``), admission's 503s (``vllite.plugins.engine_proc.admission``), the KV
connectors' (``vllite.plugins.kv_connectors.errors``), LoRA adapters' (``...transformers_executor.lora.errors``),
the benchmarks' (``vllite.plugins.bench.errors``) and the vLLM compatibility layer's (``...vllm_compat.finder``).
Their old names here still work for one release, with a ``DeprecationWarning``.
"""

from __future__ import annotations

from vllite import deprecated_aliases


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


class SessionClosedError(VlliteError, ValueError):
    """An input chunk for a session that is not open: unknown, finished (or aborted), or whose input already
    ended."""


class VLLMValidationError(VlliteError, ValueError):
    """A request's parameter is invalid (vLLM's name: a processor's ``validate_params`` raises it, and it is
    served as ``vllm.exceptions.VLLMValidationError``). ``parameter`` and ``value`` name what was rejected."""

    def __init__(self, message: str, *, parameter: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        pairs = (("parameter", self.parameter), ("value", self.value))
        extras = [f"{name}={val}" for name, val in pairs if val is not None]
        base = super().__str__()
        return f"{base} ({', '.join(extras)})" if extras else base


class CpuThreadsConfigError(VlliteError, ValueError):
    """A CPU-threads variable (``VLLITE_CPU_OMP_THREADS_BIND``, ``VLLITE_CPU_NUM_THREADS``,
    ``VLLITE_CPU_NUM_OF_RESERVED_CPU``, ...) has a value that cannot be used; the message names the variable."""


# ---------------------------------------------------------------------------- engine process / clients
class EngineStartupError(VlliteError, RuntimeError):
    """The engine could not finish starting: the engine process exited during start-up, a start-up thread died,
    the handshake timed out, or an unexpected engine answered it."""


class EngineClientError(VlliteError, RuntimeError):
    """Base class of the errors an engine client raises for a call it cannot serve (the engine itself may be fine)."""


class EngineClientClosedError(EngineClientError):
    """A request or call was sent through an engine client after :meth:`shutdown`, or was still waiting (a
    blocked ``get_output()``, an open ``AsyncLLM`` stream, a utility call) when the client was shut down."""


class EngineClientUsageError(EngineClientError):
    """A client method was called that this kind of client does not offer (e.g. the blocking ``get_output`` of
    the asyncio client)."""


class RequestProcessingError(EngineClientError):
    """The frontend failed to process one request's output (detokenizing, stop strings, logprobs): that request
    alone is finished with ``finish_reason="error"`` and aborted in the engine; the engine and the other requests
    are unaffected. ``request_id`` is the caller's id; the message names it and the cause."""

    def __init__(self, request_id: str, cause: BaseException):
        super().__init__(f"Processing the output of request {request_id!r} failed: {type(cause).__name__}: {cause}")
        self.request_id = request_id
        self.cause = cause


class UtilityCallError(EngineClientError):
    """A utility call (``sleep``, ``pause_scheduler``, ...) failed inside the engine, or was refused; the message
    is the engine's (``"Call to NAME method failed: ..."``)."""


# ---------------------------------------------------------------------------- executor
class ExecutorError(VlliteError, RuntimeError):
    """Base class of the errors an executor raises when it cannot run the model step it was given."""


class ExecutorFailedError(ExecutorError):
    """The executor reported a failure it cannot recover from (``check_health``); the engine process stops."""


class ModelExecutionError(ExecutorError):
    """One forward pass failed (raised by test executors that inject faults; real ones raise the torch error)."""


class ExecutorAsleepError(ExecutorError):
    """``execute_model`` was called while the executor sleeps; call ``wake_up()`` first."""


class KVCacheNotAllocatedError(ExecutorError):
    """The model runner was asked to run before ``initialize_kv_cache`` (or after ``sleep`` freed the cache)."""


class DeviceUnavailableError(ExecutorError):
    """The requested device (e.g. ``--device cuda``) is not available to torch in this process."""


class AttentionRoutingError(ExecutorError):
    """The model did not route attention through vllite's attention function as expected: it ran outside a
    forward context, a layer has no ``layer_idx``, the architecture bypasses transformers' attention interface
    (so vllite cannot run it), or a bidirectional (encoder) layer got an input that is not whole in its step."""


# ---------------------------------------------------------------------------- internal invariants
class InternalStateError(VlliteError, RuntimeError):
    """An internal invariant of the engine's data structures was violated: a bug in vllite or in a plugin that
    drives these structures directly, never a consequence of user input."""


class KVCacheStateError(InternalStateError):
    """The KV-cache structures were used inconsistently (a block removed from a free queue it is not in, blocks
    cached without their hashes, a prefix-cache reset that cannot succeed)."""


class BatchStateError(InternalStateError):
    """The persistent input batch, its ``BatchUpdate`` builder, the logits processors' slots or the model
    runner's request states disagree with the step being run."""


# ---------------------------------------------------------------------------- KV connectors


# ---------------------------------------------------------------------------- tools


class PluginHookError(VlliteError, RuntimeError):
    """A plugin's method raised while the engine served a request; the message names the plugin (class), the hook
    and the exception, and ``source`` (where known: the entry point and distribution the class came from). The
    engine finishes the affected request(s) with ``FinishReason.ERROR`` and goes on."""

    def __init__(self, plugin: object, hook: str, cause: BaseException, *, source: str | None = None):
        cls = plugin if isinstance(plugin, type) else type(plugin)
        self.plugin = f"{cls.__module__}.{cls.__qualname__}"
        self.hook = hook
        self.source = source
        where = f" [{source}]" if source else ""
        super().__init__(f"{self.plugin}.{hook} raised {type(cause).__name__}: {cause}{where}")


class LogitsProcessorRowsError(VlliteError, RuntimeError):
    """Raised by a logits processor's ``apply`` that failed on some rows only (a per-request processor): ``rows``
    maps each failed batch row to its message and ``logits`` is the batch with every other row processed. The
    engine fails the requests of those rows and goes on with ``logits``."""

    def __init__(self, rows: dict[int, str], logits: object):
        super().__init__(f"logits processor failed on rows {sorted(rows)}: {next(iter(rows.values()), '')}")
        self.rows = rows
        self.logits = logits


class RequestFailedError(VlliteError):
    """A request the engine finished with an error (HTTP 500): a plugin failed on it, or its output could not be
    processed. The engine goes on serving the others."""


def __getattr__(name: str) -> object:
    return deprecated_aliases.moved_attribute(__name__, name)
