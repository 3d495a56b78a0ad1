"""The HTTP server's errors, one per status it answers (``errors.classify`` maps each to OpenAI's error object):
400 ``BadRequestError`` (``RealtimeEventError`` on a realtime connection), 401 ``UnauthorizedError``, 404
``ModelNotFoundError`` / ``LoRANotFoundError`` / ``ResponseNotFoundError``, 502 ``UpstreamError`` (the disaggregation
proxy); ``BatchLineError`` is a run-batch line's error record and ``TracingUnavailableError`` a start-up refusal."""

from __future__ import annotations

from vllite.exceptions import VlliteError


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


class UnauthorizedError(VlliteError):
    """A ``/v1`` request without the server's API key (HTTP 401)."""


class UpstreamError(VlliteError):
    """A server of a disaggregation proxy's group could not be reached or broke the connection (the proxy answers
    502)."""
