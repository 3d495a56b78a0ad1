"""OpenTelemetry tracing (``vllite serve --otlp-traces-endpoint URL``, vLLM's flag): one span per finished request.

``RequestTracer`` is a ``StatLogger``: it reads the finished-request stats of each batch (never the per-token path)
and makes one ``llm_request`` span (kind SERVER) per request, from its arrival to the batch that finished it, with
vLLM's attributes (``gen_ai.request.id``, ``gen_ai.latency.time_to_first_token``, ``gen_ai.latency.time_in_queue``,
``gen_ai.usage.prompt_tokens``, ...). The span's parent is the client's span when the request came with a W3C
``traceparent`` header: ``TraceContextMiddleware`` keeps the HTTP request's trace headers in
``vllite.engine.stats.current_trace_headers`` while it is served, and the request's stats take them from there (or
from ``EngineCoreRequest.trace_headers`` when the caller set those).

Spans go to an OTLP collector over HTTP/protobuf (``opentelemetry-exporter-otlp-proto-http``), or over gRPC when
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc`` and ``opentelemetry-exporter-otlp-proto-grpc`` is installed. The SDK's
own ``OTEL_*`` variables (batch delay, headers, service name) apply. Install with ``pip install vllite[tracing]``.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from vllite.engine.stats import FinishedRequestStats, IterationStats, current_trace_headers
from vllite.plugins.openai_server.http_errors import TracingUnavailableError
from vllite.protocol import SchedulerStats

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's span attribute names (OpenTelemetry's GenAI conventions, plus vLLM's own latency ones)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def make_tracer_provider(endpoint: str, service_name: str = "vllite") -> Any:
    """An SDK ``TracerProvider`` that batches spans to the OTLP collector at ``endpoint``;
    ``TracingUnavailableError`` naming the package to install when the SDK or the exporter is missing."""
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailableError(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'vllite[tracing]' ({exc})."
        ) from None
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(endpoint)))
    return provider


def _otlp_exporter(endpoint: str) -> Any:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    try:
        if protocol == "grpc":  # an optional package, imported by name
            grpc = importlib.import_module("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
            return grpc.OTLPSpanExporter(endpoint=endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    except ImportError as exc:
        package = "opentelemetry-exporter-otlp-proto-" + ("grpc" if protocol == "grpc" else "http")
        raise TracingUnavailableError(f"--otlp-traces-endpoint needs {package} ({exc}).") from None
    return HttpExporter(endpoint=endpoint)


class RequestTracer:
    """A ``StatLogger`` that makes one span per finished request (see the module docstring).

    ``tracer_provider``: an SDK ``TracerProvider`` (``make_tracer_provider(endpoint)``, or one with an in-memory
    exporter in tests). ``model_name`` becomes ``gen_ai.response.model``.
    """

    def __init__(self, tracer_provider: Any, model_name: str | None = None) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer_provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("vllite.llm_engine")
        self.model_name = model_name
        self._propagator = TraceContextTextMapPropagator()

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        """One span per request ``iteration_stats`` finished, ending at the batch's time."""
        if iteration_stats is None:
            return
        for finished in iteration_stats.finished_requests:
            self._trace(finished, iteration_stats.iteration_timestamp)

    def shutdown(self) -> None:
        """Sends the spans still batched and stops the exporter."""
        self.tracer_provider.shutdown()

    def _trace(self, finished: FinishedRequestStats, end_time: float) -> None:
        from opentelemetry.trace import SpanKind

        context = self._propagator.extract(finished.trace_headers) if finished.trace_headers else None
        span = self.tracer.start_span(
            SPAN_NAME,
            context=context,
            kind=SpanKind.SERVER,
            start_time=_nanoseconds(finished.arrival_time or end_time - finished.e2e_latency),
            attributes=span_attributes(finished, self.model_name),
        )
        span.end(end_time=_nanoseconds(end_time))


def span_attributes(finished: FinishedRequestStats, model_name: str | None = None) -> dict[str, Any]:
    """vLLM's span attributes of one finished request (sampling parameters only where set)."""
    a = SpanAttributes
    attributes: dict[str, Any] = {
        a.GEN_AI_REQUEST_ID: finished.request_id,
        a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: finished.first_token_latency,
        a.GEN_AI_LATENCY_E2E: finished.e2e_latency,
        a.GEN_AI_LATENCY_TIME_IN_QUEUE: finished.queued_time,
        a.GEN_AI_USAGE_PROMPT_TOKENS: finished.num_prompt_tokens,
        a.GEN_AI_USAGE_COMPLETION_TOKENS: finished.num_generation_tokens,
        a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: finished.prefill_time,
        a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: finished.decode_time,
        a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: finished.inference_time,
    }
    if model_name:
        attributes[a.GEN_AI_RESPONSE_MODEL] = model_name
    params = finished.params
    if params is not None:
        for name, value in (
            (a.GEN_AI_REQUEST_N, params.n),
            (a.GEN_AI_REQUEST_MAX_TOKENS, params.max_tokens),
            (a.GEN_AI_REQUEST_TEMPERATURE, params.temperature),
            (a.GEN_AI_REQUEST_TOP_P, params.top_p),
        ):
            if value is not None:
                attributes[name] = value
    return attributes


def _nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)


ASGIApp = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]


class TraceContextMiddleware:
    """ASGI middleware: serves each HTTP request with its ``traceparent`` / ``tracestate`` headers in
    ``current_trace_headers``, where the requests it adds to the engine find them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for raw_name, raw_value in scope.get("headers", ()):
            name = raw_name.decode("latin-1").lower()
            if name in TRACE_HEADERS:
                headers[name] = raw_value.decode("latin-1")
        if "traceparent" not in headers:
            await self.app(scope, receive, send)
            return
        token = current_trace_headers.set(headers)
        try:
            await self.app(scope, receive, send)
        finally:
            current_trace_headers.reset(token)
