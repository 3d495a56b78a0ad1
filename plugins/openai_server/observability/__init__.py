"""Observability: ``metrics`` and ``metric_specs`` (the Prometheus metrics, vLLM's names) and ``tracing``
(OpenTelemetry spans and the W3C trace-context middleware).
"""
