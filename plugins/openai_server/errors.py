"""Every failure as OpenAI's error object, with the status a client can act on; never a traceback in the body.

400 a bad parameter (naming it), 401 a bad key, 404 an unknown model or route, 503 the engine is dead or shut
down, or a request refused at admission (``--max-num-queued-reqs/-tokens``), 500 a request the engine could not
complete. Streams that fail after their first event end with one error event instead (the status line has gone
out by then).
"""

from __future__ import annotations

import logging

from vllite.exceptions import EngineClientClosedError, EngineDeadError, RequestFailedError, RequestProcessingError
from vllite.outputs import CompletionOutput
from vllite.plugins.engine_proc.admission import AdmissionRejectedError
from vllite.plugins.openai_server.http_errors import BadRequestError, ModelNotFoundError, UnauthorizedError
from vllite.plugins.openai_server.responses import ErrorInfo, ErrorResponse, sse

logger = logging.getLogger("vllite.server")

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}  # fmt: skip


def error_response(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """The error body for ``status``."""
    return ErrorResponse(error=ErrorInfo(message=message, type=_TYPES.get(status, "Error"), param=param, code=status))


def classify(exc: BaseException) -> tuple[int, ErrorResponse]:
    """The status and body for an exception a route raised."""
    if isinstance(exc, BadRequestError):
        return 400, error_response(400, str(exc), exc.param)
    if isinstance(exc, ModelNotFoundError):
        return 404, error_response(404, str(exc), "model")
    if isinstance(exc, UnauthorizedError):
        return 401, error_response(401, str(exc))
    if isinstance(exc, (EngineDeadError, EngineClientClosedError)):
        return 503, error_response(503, f"The engine is not available: {exc}")
    if isinstance(exc, AdmissionRejectedError):  # vLLM's body for its admission limits, "type" included
        return 503, ErrorResponse(error=ErrorInfo(message=str(exc), type="Service Unavailable", param=None, code=503))
    if isinstance(exc, (RequestFailedError, RequestProcessingError)):
        return 500, error_response(500, str(exc))
    if isinstance(exc, (ValueError, TypeError)):
        return 400, error_response(400, str(exc))
    logger.error("Unexpected server error: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return 500, error_response(500, f"Internal server error ({type(exc).__name__}).")


def error_event(exc: BaseException | str, status: int = 500) -> bytes:
    """One SSE event carrying an error object (the openai client raises it as an ``APIError``)."""
    if isinstance(exc, BaseException):
        status, body = classify(exc)
    else:
        body = error_response(status, exc)
    return sse(body)


def check_sample(sample: CompletionOutput) -> None:
    """Raises :class:`RequestFailedError` for a sample the engine finished with an error."""
    if sample.finish_reason == "error":
        raise RequestFailedError(f"The request failed in the engine: {sample.error or 'unknown error'}")
