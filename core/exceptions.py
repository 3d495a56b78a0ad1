"""The one small exception hierarchy of vllite.

Every error the engine raises on purpose derives from :class:`VlliteError`, so callers can catch the
engine's own failures without swallowing programming errors. Bad user input stays a plain
``ValueError`` (as in vLLM), because that is what users and HTTP layers already map to a 400.

The hierarchy (a class in brackets is a second base, kept so that callers catching it keep working)::

    VlliteError
    ├── PluginLoadError ── DuplicateComponentError
    ├── UnknownComponentError [ValueError], ModelLoadError [ValueError], KVCacheMemoryError [ValueError]
    ├── VLLMValidationError [ValueError], VllmCompatImportError [ModuleNotFoundError]
    ├── CpuThreadsConfigError [ValueError]
    ├── EngineDeadError
    ├── EngineStartupError [RuntimeError]
    ├── EngineClientError [RuntimeError] ── EngineClientClosedError, EngineClientUsageError, UtilityCallError,
    │                                       RequestProcessingError
    ├── ExecutorError [RuntimeError] ── ExecutorFailedError, ModelExecutionError, ExecutorAsleepError,
    │                                   KVCacheNotAllocatedError, DeviceUnavailableError, AttentionRoutingError
    ├── InternalStateError [RuntimeError] ── KVCacheStateError, BatchStateError
    ├── PluginHookError [RuntimeError], LogitsProcessorRowsError [RuntimeError]
    ├── KVBlockFileError, KVLoadError, KVConnectorConformanceError, P2PTransferError
    ├── BenchReplayError [RuntimeError], ServeBenchError [RuntimeError]
    ├── LoRAAdapterError [ValueError] (an adapter that cannot be loaded or run)
    ├── SessionClosedError [ValueError] (an input chunk for a session that is not open)
    ├── TracingUnavailableError (--otlp-traces-endpoint without the OpenTelemetry packages), BatchLineError
    │   (a run-batch line that cannot run: its error record)
    ├── the HTTP server's, one per status: BadRequestError [ValueError] (400) ── RealtimeEventError (an error
    │   event on a /v1/realtime connection), UnauthorizedError (401),
    │   ModelNotFoundError (404) ── LoRANotFoundError, ResponseNotFoundError (404), RequestFailedError (500),
    │   AdmissionRejectedError (503) ── QueueOverflowError, MaxQueuedTokensError
    └── UpstreamError (the disaggregation proxy could not reach a server: it answers 502)
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


class VllmCompatImportError(VlliteError, ModuleNotFoundError):
    """A ``vllm.*`` name that vllite's vLLM compatibility layer does not serve (no real vLLM is installed); the
    message names it and lists what the layer does serve."""


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
class KVBlockFileError(VlliteError):
    """A stored KV block file is missing, truncated, corrupt (checksum mismatch) or of another KV layout: the
    connector treats it as a miss (or reports its blocks as failed loads), never loads it as KV."""


class KVLoadError(VlliteError):
    """A KV connector could not load a request's external KV (it reported the blocks as failed) and
    ``kv_load_failure_policy`` is ``fail``: the request ends with ``FinishReason.ERROR`` carrying this message."""


class P2PTransferError(VlliteError):
    """The ``p2p`` connector's fetch of a request's KV from its producer failed (unreachable, timed out,
    refused or malformed): the blocks are reported as failed loads, handled per ``kv_load_failure_policy``."""


# ---------------------------------------------------------------------------- tools
class KVConnectorConformanceError(VlliteError, AssertionError):
    """A KV connector broke a rule of the contract under ``vllite.testing.kv_connector_conformance`` (an
    ``AssertionError`` too, so pytest reports it as a failed check); the message names the rule."""


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


class BenchReplayError(VlliteError, RuntimeError):
    """The agent-bench replay cannot progress: jobs are unfinished with nothing in flight, or the engine stalled."""


class ServeBenchError(VlliteError, RuntimeError):
    """``vllite bench serve`` cannot run: the server is unreachable, lists no model, or fails the warm-up request."""


# ---------------------------------------------------------------------------------------------- the HTTP server
class BadRequestError(VlliteError, ValueError):
    """A request the server rejects with HTTP 400; ``param`` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RealtimeEventError(BadRequestError):
    """A client event the server refuses: answered with one ``error`` event (``code``, ``param``, and the client's
    ``event_id``) on that connection; the session goes on."""

    def __init__(self, message: str, *, code: str, param: str | None = None, event_id: str | None = None) -> None:
        super().__init__(message, param)
        self.code = code
        self.event_id = event_id


class BatchLineError(VlliteError):
    """A line of a ``vllite run-batch`` input file that cannot run: the HTTP status the server would answer, and
    OpenAI's error fields (written as that line's error record)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class TracingUnavailableError(VlliteError):
    """``--otlp-traces-endpoint`` was given but the OpenTelemetry SDK or its OTLP exporter is not installed."""


class ModelNotFoundError(VlliteError):
    """The request names a model the server does not serve (HTTP 404); the message lists ``served``, if given."""

    def __init__(self, name: str, served: tuple[str, ...] = ()) -> None:
        listed = f" This server serves: {', '.join(served)}." if served else ""
        super().__init__(f"The model `{name}` does not exist.{listed}")
        self.name = name


class LoRANotFoundError(ModelNotFoundError):
    """An adapter the server does not serve (HTTP 404), with vLLM's message."""

    def __init__(self, name: str) -> None:
        VlliteError.__init__(self, f"The lora adapter '{name}' cannot be found.")
        self.name = name


class ResponseNotFoundError(VlliteError):
    """No stored Responses-API response has this id (never stored, ``store: false``, or forgotten): HTTP 404;
    ``param`` names the request field that gave it."""

    def __init__(self, response_id: str, param: str | None = None) -> None:
        super().__init__(f"Response with id {response_id!r} not found.")
        self.param = param


class LoRAAdapterError(VlliteError, ValueError):
    """A LoRA adapter cannot be loaded or run; the message names the adapter and exactly what is wrong (a
    ``ValueError`` too, as vLLM raises for bad adapters, so an HTTP layer answers 400)."""


class UnauthorizedError(VlliteError):
    """A ``/v1`` request without the server's API key (HTTP 401)."""


class UpstreamError(VlliteError):
    """A server of a disaggregation proxy's group could not be reached or broke the connection (the proxy answers
    502)."""


class AdmissionRejectedError(VlliteError):
    """A request refused before it reaches the engine because the server has too much work in flight (HTTP 503, so
    that a load balancer retries elsewhere; vLLM's ``GracefulHTTPError``): ``reason`` names the limit, as the
    ``reason`` label of ``admission_rejections_total``; the message is vLLM's."""

    reason = ""
    message = ""

    def __init__(self) -> None:
        super().__init__(self.message)


class QueueOverflowError(AdmissionRejectedError):
    """``--max-num-queued-reqs``: the requests in flight (waiting or running) plus the new one's ``n`` exceed it."""

    reason = "max_num_queued_reqs"
    message = (
        "The engine is currently busy and cannot accept new requests. Please try again later or on a different "
        "instance."
    )


class MaxQueuedTokensError(AdmissionRejectedError):
    """``--max-num-queued-tokens``: the prompt tokens of the requests still waiting for their first token reach it."""

    reason = "max_num_queued_tokens"
    message = (
        "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."
    )


class RequestFailedError(VlliteError):
    """A request the engine finished with an error (HTTP 500): a plugin failed on it, or its output could not be
    processed. The engine goes on serving the others."""
