"""OpenTelemetry tracing (``vllite.plugins.openai_server.observability.tracing``): one span per finished request with
vLLM's attributes, built from the finished-request stats; a client's ``traceparent`` header becomes the span's parent.
End to end: ``vllite serve --otlp-traces-endpoint`` exporting to a tiny OTLP/HTTP receiver in the test."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from vllite.engine.stats import IterationStats, RequestStateStats, current_trace_headers
from vllite.plugins.openai_server.observability.tracing import RequestTracer, TraceContextMiddleware
from vllite.plugins.openai_server.testing import RemoteServer
from vllite.protocol import EngineCoreRequest
from vllite.sampling_params import SamplingParams
from vllite.testing import make_tiny_model_dir_cached

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


def test_one_span_per_finished_request_with_vllm_attributes_and_the_callers_parent():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider, model_name="tiny")
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9)
    traced = EngineCoreRequest("e1", [1, 2, 3], params, None, 100.0, trace_headers={"traceparent": TRACEPARENT})
    plain = EngineCoreRequest("e2", [1, 2], params, None, 100.0)
    it = IterationStats(iteration_timestamp=101.5)
    for request, external in ((traced, "cmpl-1"), (plain, "cmpl-2")):
        stats = RequestStateStats.for_request(request, external)
        stats.queued_ts, stats.scheduled_ts = 10.0, 10.25
        stats.record_tokens(1, 0, now=10.5, prompt_len=3, iteration=it)
        stats.record_tokens(2, 0, now=11.0, iteration=it)
        it.record_finished("length", len(request.prompt_token_ids or ()), stats)
    tracer.record(None, it)
    tracer.record(None, None)
    spans = {span.attributes["gen_ai.request.id"]: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"cmpl-1", "cmpl-2"}
    span = spans["cmpl-1"]
    assert span.name == "llm_request" and span.kind.name == "SERVER"
    assert span.start_time == 100_000_000_000 and span.end_time == 101_500_000_000
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert spans["cmpl-2"].parent is None
    a = span.attributes
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(101.5 - 100.0)
    assert a["gen_ai.latency.e2e"] == pytest.approx(1.5)
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.25)
    assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(0.25)
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(0.5)
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(0.75)
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (3, 3)
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.n"]) == (8, 1)
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7) and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.response.model"] == "tiny"


def test_middleware_exposes_the_http_requests_trace_headers():
    seen = []

    async def app(scope, receive, send):
        seen.append(current_trace_headers.get())

    middleware = TraceContextMiddleware(app)
    headers = [(b"traceparent", TRACEPARENT.encode()), (b"tracestate", b"k=v"), (b"x-other", b"1")]
    asyncio.run(middleware({"type": "http", "headers": headers}, None, None))
    asyncio.run(middleware({"type": "http", "headers": []}, None, None))
    assert seen == [{"traceparent": TRACEPARENT, "tracestate": "k=v"}, None]
    assert current_trace_headers.get() is None
    # A request's stats made while serving take the headers (the request's own win).
    token = current_trace_headers.set({"traceparent": TRACEPARENT})
    try:
        assert RequestStateStats(arrival_time=0.0).trace_headers == {"traceparent": TRACEPARENT}
        own = RequestStateStats(
            arrival_time=0.0, trace_headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
        )
        assert own.trace_headers is not None and own.trace_headers["traceparent"] != TRACEPARENT
    finally:
        current_trace_headers.reset(token)


class _Collector(ThreadingHTTPServer):
    """A tiny OTLP/HTTP receiver: decodes each ``POST /v1/traces`` body and keeps its spans."""

    def __init__(self) -> None:
        self.spans: list = []
        self.paths: list[str] = []
        super().__init__(("127.0.0.1", 0), _CollectorHandler)


class _CollectorHandler(BaseHTTPRequestHandler):
    server: _Collector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.server.paths.append(self.path)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.server.spans.extend(scope_spans.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_serve_exports_spans_to_an_otlp_collector_with_the_callers_parent():
    collector = _Collector()
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    model = str(make_tiny_model_dir_cached("llama"))
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    args = [model, "--served-model-name", "tiny", "--max-model-len", "128", "--dtype", "float32"]
    env = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
    try:
        with RemoteServer([*args, "--otlp-traces-endpoint", endpoint, "--disable-log-stats"], env=env) as remote:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "temperature": 0.5}
            for headers in ({"traceparent": TRACEPARENT}, {}):
                request = urllib.request.Request(
                    remote.url + "/v1/completions",
                    data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json", **headers},
                )
                with urllib.request.urlopen(request, timeout=60) as response:
                    assert response.status == 200
            # --disable-log-stats: no /metrics, yet the tracer gets its stats.
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(remote.url + "/metrics", timeout=30)
            deadline = time.monotonic() + 30
            while len(collector.spans) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        collector.shutdown()
    assert collector.paths and set(collector.paths) == {"/v1/traces"}
    assert len(collector.spans) == 2
    parented = [s for s in collector.spans if s.parent_span_id]
    assert len(parented) == 1
    span = parented[0]
    assert (
        span.name == "llm_request" and span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    )
    attributes = {kv.key: kv.value for kv in span.attributes}
    assert attributes["gen_ai.usage.completion_tokens"].int_value == 3
    assert attributes["gen_ai.usage.prompt_tokens"].int_value > 0
    assert attributes["gen_ai.latency.time_to_first_token"].double_value > 0
    assert (
        attributes["gen_ai.latency.e2e"].double_value >= attributes["gen_ai.latency.time_to_first_token"].double_value
    )
    assert "gen_ai.latency.time_in_queue" in attributes
    # the request's id and sampling parameters reach its stats
    assert attributes["gen_ai.request.id"].string_value.startswith("cmpl-")
    assert attributes["gen_ai.request.max_tokens"].int_value == 3
    assert attributes["gen_ai.request.temperature"].double_value == pytest.approx(0.5)
